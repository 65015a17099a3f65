"""Model cards (`README.md`) for Domino drafts, written with huggingface_hub's `ModelCard` / `ModelCardData`.

The card has Hub metadata (base model, library, pipeline tag, tags, license, datasets), usage snippets (transformers
`generate(assistant_model=draft)`, the native `speculative_generate`, SGLang), the training details when known
(`training_summary.json`, else `trainer_state.json`) and the acceptance table when `bench_results.json` exists.
DominoTrainer writes it into every checkpoint and output folder; `domino-spec card DIR` (re)writes it and can upload
the folder with huggingface_hub (`--push-to-hub`).
"""

import argparse
import json
import math
import os
import shutil

from huggingface_hub import HfApi, ModelCard, ModelCardData

from ..configuration_domino import DominoConfig
from ..published_format import draft_config

CARD_NAME = "README.md"
TRAINING_SUMMARY = "training_summary.json"
TRAINER_STATE = "trainer_state.json"
BENCH_RESULTS = "bench_results.json"
TAGS = ["speculative-decoding", "domino", "dflash"]
DEFAULT_LICENSE = "apache-2.0"
PAPER = "https://arxiv.org/abs/2605.29707"
# TrainingArguments / DominoTrainingArguments fields worth stating on a card.
SUMMARY_ARGUMENTS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_grad_norm",
    "bf16",
    "seed",
    "num_anchors",
    "lambda_start",
    "decay_ratio",
    "loss_gamma",
    "training_time_test",
    "soft_targets",
)
LOGGED_METRICS = ("loss", "loss_base", "loss_final", "lam", "acceptance_base", "acceptance_final")
# What a folder upload holds, by allowlist: the weights, the JSON at the root (config.json, generation_config.json,
# model.safetensors.index.json, training_summary.json, bench_results.json), the model code and the card. Never a
# pickle: Trainer's training_args.bin holds a `--hub_token` in clear text, and its optimizer, scheduler and RNG state
# are pickles too.
UPLOAD_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.py", CARD_NAME]
# huggingface_hub's `*` also matches "/": this keeps the allowlist to the folder's root, without checkpoint-N/.
UPLOAD_IGNORE_PATTERNS = ["*/*"]


# ---------------------------------------------------------------------- inputs


def _json_value(value):
    """`value` if JSON can hold it as is, else its string (enums, paths)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def training_summary(args, state, data: dict | None = None) -> dict:
    """What a card says about training, from a Trainer's `args` and `state` (the last logged metrics included), and
    the `data` summary when known (counts, and the regeneration settings under `generation`)."""
    summary = {name: _json_value(getattr(args, name)) for name in SUMMARY_ARGUMENTS if hasattr(args, name)}
    if data is not None:
        summary["data"] = data
    summary.update(global_step=state.global_step, max_steps=state.max_steps, epoch=_json_value(state.epoch))
    logged = [entry for entry in state.log_history if "loss" in entry]
    if logged:
        summary["last_logged"] = {key: _json_value(logged[-1][key]) for key in LOGGED_METRICS if key in logged[-1]}
    return summary


def read_json(folder: str, name: str) -> dict | None:
    """The JSON object in `folder/name`, None when the file is absent; `ValueError` naming it when unreadable."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable JSON file: {error}") from error


def training_details(folder: str) -> dict | None:
    """`training_summary.json` of the folder, else the summary a Trainer's `trainer_state.json` gives."""
    summary = read_json(folder, TRAINING_SUMMARY)
    if summary is not None:
        return summary
    state = read_json(folder, TRAINER_STATE)
    if state is None:
        return None
    summary = {key: state.get(key) for key in ("global_step", "max_steps", "epoch", "train_batch_size") if key in state}
    logged = [entry for entry in state.get("log_history", []) if "loss" in entry]
    if logged:
        summary["last_logged"] = {key: logged[-1][key] for key in LOGGED_METRICS if key in logged[-1]}
    return summary


def hub_model_id(name: str | None) -> str | None:
    """`name` when it reads as a Hub repo id ("owner/model"), None for local paths and asset names."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None
    return name


# ---------------------------------------------------------------------- sections


def _table(rows: list[tuple[str, object]]) -> str:
    lines = ["| | |", "|---|---|"] + [f"| {key} | {value} |" for key, value in rows]
    return "\n".join(lines)


def overview_section(config: DominoConfig, target: str) -> str:
    kind = "Domino (DFlash backbone + causal correction head)" if config.use_domino_head else "DFlash (backbone only)"
    rows = [
        ("method", kind),
        ("target", f"`{target}`"),
        ("draft layers", config.num_hidden_layers),
        ("block size", f"{config.block_size} ({config.num_draft_tokens} drafts per block)"),
        ("tapped target layers", list(config.target_layer_ids)),
        ("mask token id", config.mask_token_id),
    ]
    if config.use_domino_head:
        rows.append(("head", f"GRU {config.gru_hidden_dim}, logit residual rank {config.residual_rank}"))
    intro = (
        f"A speculative-decoding draft for `{target}`. The draft proposes a block of tokens in one parallel pass, "
        "conditioned on the target's hidden states; the target verifies the block in one forward pass and keeps the "
        "drafts it accepts, so greedy output is exactly the target's own and sampled output follows the target's "
        "distribution. The target's embeddings and LM head are used at call time and are not part of this checkpoint. "
        f"Method: Domino ({PAPER})."
    )
    return f"{intro}\n\n{_table(rows)}"


def usage_section(repo_id: str, target: str, config: DominoConfig, published: bool) -> str:
    # The model code reads our own format only: the package converts a published-format folder (`load_draft`).
    if published:
        load = f"""from domino_spec.published_format import load_draft  # pip install domino-spec

draft = load_draft("{repo_id}", dtype=target.dtype).to(target.device)"""
    else:
        load = f'draft = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True, dtype=target.dtype)'
        load += ".to(target.device)"
    transformers_snippet = f"""```python
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")
tokenizer = AutoTokenizer.from_pretrained("{target}")
{load}

messages = [{{"role": "user", "content": "How many positive divisors does 196 have?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True).to(
    target.device
)
output = target.generate(**inputs, assistant_model=draft, max_new_tokens=256, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
```"""
    if published:
        transformers_snippet += (
            "\nThis folder is in the published (SGLang) format, which the model code does not read "
            "(`AutoModel.from_pretrained` refuses it, naming `load_draft`): the `domino-spec` package converts it."
        )
    native_snippet = f"""```python
# pip install domino-spec  (batched, greedy or exact speculative sampling)
from domino_spec.generation import speculative_generate
from domino_spec.published_format import load_draft

draft = load_draft("{repo_id}", dtype=target.dtype).to(target.device)
result = speculative_generate(
    target, draft, inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=256
)
print(tokenizer.decode(result.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("mean acceptance length:", result.mean_acceptance_length)
```"""
    sglang_head_note = (
        "; with the Domino head it also needs the target's full vocabulary and a bf16 target, and drafts greedily "
        "(serve with temperature 0)"
        if config.use_domino_head
        else ""
    )
    # SGLang serves the published layout only: a folder in our own format is served from its export.
    export_note, served_path = (
        ("This folder is in the published layout SGLang serves", repo_id)
        if published
        else ("SGLang serves the exported folder: domino-spec export --format sglang DRAFT_DIR OUT", "OUT")
    )
    sglang_snippet = f"""```bash
# {export_note}
python -m sglang.launch_server \\
    --model-path {target} \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {served_path} \\
    --speculative-num-draft-tokens {config.block_size} \\
    --dtype bfloat16 \\
    --trust-remote-code
```
SGLang needs CUDA and bf16 weights (the export writes bf16){sglang_head_note}."""
    return (
        "## Usage\n\n### transformers: `generate(assistant_model=draft)`\n\n"
        + transformers_snippet
        + "\n\n### Native batched engine\n\n"
        + native_snippet
        + "\n\n### Serving with SGLang\n\n"
        + sglang_snippet
    )


def upload_section(repo_id: str, published: bool) -> str:
    """How to upload the folder: as is when it is in the published (SGLang) format, which a `push_to_hub` of the
    loaded draft would replace by our own."""
    if published:
        how = f"""This folder is in the published Domino / DFlash format that SGLang serves: upload it as is,
card included, with `domino-spec card DRAFT_DIR --push-to-hub {repo_id}`, or from Python:

```python
from huggingface_hub import HfApi

HfApi().create_repo("{repo_id}", exist_ok=True)
HfApi().upload_folder(folder_path="DRAFT_DIR", repo_id="{repo_id}")
```
Do not `push_to_hub` a draft loaded from it: that saves domino-spec's own format (`model_type: "domino"`, no
`dflash_config`), which SGLang cannot serve."""
    else:
        how = f"""```python
draft.push_to_hub("{repo_id}")  # weights, config.json and the model code (trust_remote_code)
from huggingface_hub import ModelCard

ModelCard.load("DRAFT_DIR/README.md").push_to_hub("{repo_id}")
```
or, for the whole draft (card, weights, code, training summary; never the folder's pickles such as
`training_args.bin`, nor its `checkpoint-N` folders): `domino-spec card DRAFT_DIR --push-to-hub {repo_id}`."""
    return f"## Uploading\n\n{how}\nLog in first with `hf auth login` (or set `HF_TOKEN`)."


def data_rows(data: dict) -> list[tuple[str, object]]:
    """The card's rows on the training data: its size, and which mode the target answered in."""
    rows = [("training examples", f"{data.get('examples')} ({data.get('response_tokens')} response tokens)")]
    generation = data.get("generation")
    if generation is None:
        return rows + [("responses", "not regenerated by domino-spec: mode unknown")]
    temperature = generation.get("temperature")
    thinking = {True: "on", False: "off", None: "the chat template's default"}.get(generation.get("thinking"))
    sampling = "greedy" if not temperature else f"sampled at temperature {temperature}"
    return rows + [
        ("responses", f"regenerated by the target, {sampling}, at most {generation.get('max_new_tokens')} tokens"),
        ("thinking", thinking),
    ]


def curve_rows(curve: dict) -> list[tuple[str, object]]:
    """The card's rows on every session that trained the draft (a warm start goes on from the last): the totals of
    the last point of its learning curve, which `ship.py --curve` records."""
    return [
        ("steps, all sessions", curve["step"]),
        ("training examples seen, all sessions", curve["examples"]),
        ("CPU-hours of training, all sessions", curve["cpu_hours"]),
        ("learning curve", f"`{curve['results']}`"),
    ]


def training_section(summary: dict) -> str:
    last_logged = summary.get("last_logged") or {}
    skipped = ("last_logged", "datasets", "license", "data", "curve")
    rows = data_rows(summary["data"]) if summary.get("data") else []
    rows += curve_rows(summary["curve"]) if summary.get("curve") else []
    rows += [(key, value) for key, value in summary.items() if key not in skipped]
    rows += [(f"last logged {key}", value) for key, value in last_logged.items()]
    return "## Training\n\n" + _table(rows)


def _number(value, suffix: str = "") -> str:
    return "n/a" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.2f}{suffix}"


def acceptance_section(bench: dict) -> str:
    """The batch-1 greedy rows after a warm-up of `bench_results.json` (`results`: eval_set, method,
    mean_acceptance_length, tokens_per_s, speedup, identical; a bench of several settings has others too), with the
    machine and versions they were measured on."""
    lines = [
        "| eval set | method | mean acceptance length | drafts verified per round | rounds looked up | tokens/s | "
        "speedup | speedup over eager generate | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in filter(is_batch_1_greedy_warm, bench.get("results", [])):
        identical = row.get("identical")
        if isinstance(identical, int) and not isinstance(identical, bool) and row.get("prompts"):
            identical = f"{identical}/{row['prompts']}"
        lines.append(
            f"| {row.get('eval_set', '')} | {row.get('method', '')} | {_number(row.get('mean_acceptance_length'))} | "
            f"{_number(row.get('drafts_per_round'))} | {_number(row.get('looked_up_fraction'))} | "
            f"{_number(row.get('tokens_per_s'))} | "
            f"{_number(row.get('speedup'), 'x')} | {_number(row.get('speedup_over_eager'), 'x')} | {identical} |"
        )
    notes = [
        f"{name}: `{json.dumps(bench[name], sort_keys=True)}`" for name in ("machine", "versions") if bench.get(name)
    ]
    return (
        f"## Acceptance and speed\n\n{bench_settings(bench.get('config') or {})}\n\n"
        + "\n".join(lines)
        + ("\n\n" + "\n\n".join(notes) if notes else "")
    )


def is_batch_1_greedy_warm(row: dict) -> bool:
    """Whether a `bench_results.json` row was measured at batch 1, greedy, after a warm-up (rows without these
    columns were)."""
    return row.get("batch_size", 1) == 1 and not row.get("do_sample") and row.get("timing", "warm") == "warm"


def bench_settings(config: dict) -> str:
    """What the acceptance table measured: `domino-spec bench`'s settings (its `config`) and its method names."""
    settings = ["Greedy decoding (`domino-spec bench`)"]
    if config.get("max_new_tokens"):
        settings.append(f"at most {config['max_new_tokens']} new tokens")
    prompts = config.get("prompts")
    if isinstance(prompts, dict) and len(set(prompts.values())) == 1:
        settings.append(f"the first {next(iter(prompts.values()))} prompts of each set")
    described = config.get("method_descriptions") or {}
    methods = ", ".join(
        f"{name} ({described[name]})" if name in described else name for name in config.get("methods", [])
    )
    return (
        f"{', '.join(settings)}. Speedup is over plain decoding of the same prompts in the same loop "
        f"(plain-native for the native engine's methods). Methods: {methods}."
    )


# ---------------------------------------------------------------------- the card


def build_model_card(
    folder: str, repo_id: str | None = None, license_id: str | None = None, datasets: list[str] | str | None = None
) -> ModelCard:
    """The card of the draft folder `folder`; `repo_id` names it in the usage snippets."""
    config, published = draft_config(folder)
    summary = training_details(folder) or {}
    bench = read_json(folder, BENCH_RESULTS)
    target = config.target_model_name or "TARGET_MODEL"
    repo_id = repo_id or "DRAFT_REPO_OR_DIR"
    datasets = datasets or summary.get("datasets")
    card_data = ModelCardData(
        base_model=hub_model_id(config.target_model_name),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        license=license_id or summary.get("license") or DEFAULT_LICENSE,
        datasets=[datasets] if isinstance(datasets, str) else datasets,
    )
    title = "Domino" if config.use_domino_head else "DFlash"
    sections = [
        f"# {title} draft for {target}",
        overview_section(config, target),
        usage_section(repo_id, target, config, published),
    ]
    if summary:
        sections.append(training_section(summary))
    if bench and bench.get("results"):
        sections.append(acceptance_section(bench))
    sections.append(upload_section(repo_id if repo_id != "DRAFT_REPO_OR_DIR" else "your-name/your-draft", published))
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def write_model_card(folder: str, training: dict | None = None, **card_kwargs) -> str:
    """Write `README.md` (and `training_summary.json` when `training` is given) into `folder`; returns the card path."""
    if training is not None:
        with open(os.path.join(folder, TRAINING_SUMMARY), "w", encoding="utf-8") as file:
            json.dump(training, file, indent=2)
    path = os.path.join(folder, CARD_NAME)
    build_model_card(folder, **card_kwargs).save(path)
    return path


def push_folder_to_hub(folder: str, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Upload a draft folder to the Hub with huggingface_hub: only the files at its root that `UPLOAD_ALLOW_PATTERNS`
    names (weights, JSON, model code, card), never the pickles (`training_args.bin` with any Hub token, optimizer,
    scheduler and RNG state) or `checkpoint-N` folders a `domino-spec train` output folder also holds; returns the
    commit URL."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(
        folder_path=folder,
        repo_id=repo_id,
        commit_message="Upload Domino draft",
        allow_patterns=UPLOAD_ALLOW_PATTERNS,
        ignore_patterns=UPLOAD_IGNORE_PATTERNS,
    )
    return str(commit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="domino-spec card", description="Write (and optionally upload) a model card.")
    parser.add_argument("folder", metavar="DIR", help="a draft folder")
    parser.add_argument(
        "--repo-id", default=None, help="Hub repo id used in the usage snippets (and for --push-to-hub)"
    )
    parser.add_argument("--license", default=None, help=f"license tag (default: {DEFAULT_LICENSE})")
    parser.add_argument("--datasets", default=None, help="comma-separated Hub dataset ids used for training")
    parser.add_argument("--bench", default=None, help="a bench_results.json to copy into DIR and show")
    parser.add_argument(
        "--push-to-hub",
        default=None,
        metavar="REPO",
        help="upload DIR to this Hub repo afterwards: only its root's *.safetensors, *.json, *.py and README.md "
        "(no pickles such as training_args.bin, which holds any --hub_token; no checkpoint-N folders)",
    )
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    args = parser.parse_args(argv)
    bench_copy = os.path.join(args.folder, BENCH_RESULTS)
    if args.bench and os.path.abspath(args.bench) != os.path.abspath(bench_copy):
        shutil.copyfile(args.bench, bench_copy)
    datasets = [name for name in (args.datasets or "").split(",") if name] or None
    path = write_model_card(
        args.folder, repo_id=args.repo_id or args.push_to_hub, license_id=args.license, datasets=datasets
    )
    print(f"wrote {path}")
    if args.push_to_hub:
        print(push_folder_to_hub(args.folder, args.push_to_hub, private=args.private))
