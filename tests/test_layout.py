"""The package's imports run one way: the model files under generation/ and training/, which never import each other;
and a checkpoint runs a small, fixed set of files."""

import ast
import io
import tokenize
from pathlib import Path

from transformers.dynamic_module_utils import get_imports, get_relative_import_files

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = {path.name for path in map(Path, get_relative_import_files(str(ROOT / "modeling_domino.py")))}
MODEL_FILES |= {"modeling_domino.py"}
# The one package module a checkpoint's code uses where the package is installed, and runs without.
OPTIONAL_PACKAGE_MODULE = "domino_spec.cost_aware"


def imported_modules(path: Path) -> set[str]:
    """Modules a file imports, relative ones resolved against the package `domino_spec` (the repository root)."""
    package = ["domino_spec", *path.parent.relative_to(ROOT).parts]
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            modules.add(module)
            modules |= {f"{module}.{alias.name}" for alias in node.names}  # `from . import assets`
    return modules


def test_generation_and_training_never_import_each_other():
    for folder, other in (("generation", "training"), ("training", "generation")):
        for path in (ROOT / folder).rglob("*.py"):
            wrong = {m for m in imported_modules(path) if m.startswith(f"domino_spec.{other}")}
            assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_the_model_files_a_checkpoint_carries_import_only_torch_transformers_and_each_other():
    allowed_roots = {"torch", "transformers"}
    stdlib = {"collections", "contextlib", "dataclasses", "functools", "inspect", "itertools", "json", "math", "os"}
    stdlib |= {"statistics", "struct", "time", "typing", "warnings", "weakref"}
    assert {"configuration_domino.py", "head_domino.py", "generation_domino.py", "drafting.py"} <= MODEL_FILES
    for name in MODEL_FILES:
        # What transformers requires to load the file (imports inside a try block are optional).
        required = {module.split(".")[0] for module in get_imports(str(ROOT / name))}
        assert required <= allowed_roots | stdlib, f"{name} requires {sorted(required - allowed_roots - stdlib)}"
        for module in imported_modules(ROOT / name):
            if module.startswith("domino_spec.") and f"{module.split('.')[1]}.py" not in MODEL_FILES:
                assert module.startswith(OPTIONAL_PACKAGE_MODULE), f"{name} imports {module}, outside the model"


# What `AutoModel.from_pretrained(..., trust_remote_code=True)` runs: the model file and the root files it imports. The
# package adds the rest (published-format conversion, compiled drafting, the fused Triton head step, building drafts).
CHECKPOINT_CODE_FILES = {
    "configuration_domino.py",
    "modeling_domino.py",
    "head_domino.py",
    "drafting.py",
    "cache_domino.py",
    "generation_domino.py",
    "transformers_compat.py",
}
# What a Hub user audits: code lines (neither blank, nor comments, nor docstrings) and all lines. Move code to the
# package (generation/, training/, or a root file the model does not import) before raising these.
MAX_CHECKPOINT_CODE_LINES = 1500
MAX_CHECKPOINT_LINES = 2200


def code_lines(path: Path) -> int:
    """Lines of `path` holding code: neither blank, nor comments only, nor docstrings."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings |= set(range(first.lineno, first.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines |= set(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_a_checkpoint_runs_a_small_fixed_set_of_files():
    assert MODEL_FILES == CHECKPOINT_CODE_FILES
    code = sum(code_lines(ROOT / name) for name in MODEL_FILES)
    total = sum(len((ROOT / name).read_text().splitlines()) for name in MODEL_FILES)
    assert code <= MAX_CHECKPOINT_CODE_LINES, (
        f"a checkpoint runs {code} lines of code, more than {MAX_CHECKPOINT_CODE_LINES}"
    )
    assert total <= MAX_CHECKPOINT_LINES, (
        f"a checkpoint's code files hold {total} lines, more than {MAX_CHECKPOINT_LINES}"
    )
