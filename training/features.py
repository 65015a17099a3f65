"""Target features for training: computed online each step, or once into an on-disk store reused by every epoch
and every draft trained on the same data (the target pass is most of a step's cost for small drafts on CPU).

Only the tapped layers are kept, and the target stops after the last of them: its later layers and its LM head
never run, unless the draft trains on soft targets (the target's K likeliest next tokens and their probabilities
at every position).
"""

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

SIGNATURE_VALUES = 256  # leading values of each target weight hashed into its signature
# A store's files, each a [tokens, width] array of all examples back to back: the features (width: the tapped
# layers' hidden sizes), and with soft targets the target's likeliest next tokens and their probabilities (top_k).
STORE_DTYPES = {"features.bin": np.float16, "top_ids.bin": np.int32, "top_probs.bin": np.float16}


class _StopAfterLastTappedLayer(Exception):
    pass


@dataclass
class TargetFeatures:
    """What a training step reads from the target for a batch."""

    hidden: torch.Tensor  # [B, T, len(layer_ids) * D]: the tapped layers' outputs, concatenated
    top_ids: torch.Tensor | None = None  # [B, T, K]: the K likeliest tokens after each position (soft targets)
    top_probs: torch.Tensor | None = None  # [B, T, K]: their probabilities under the target, in decreasing order


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int], top_k: int = 0
) -> TargetFeatures:
    """The outputs of target layers `layer_ids`, and with `top_k` the target's `top_k` likeliest next tokens.

    Forward hooks on the tapped decoder layers capture their outputs; without `top_k` the last one ends the forward
    early. The same features as inference reads from `output_hidden_states`
    (`DominoDraftModel.fuse_target_hidden_states`): the target runs in its own dtype even inside a bf16-autocast
    training step, as it does in a feature store and in decoding.
    """
    decoder = target.get_decoder()
    layers = decoder.layers
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids) if not top_k else None

    def capture(index):
        def hook(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == last:
                raise _StopAfterLastTappedLayer

        return hook

    handles = [layers[i].register_forward_hook(capture(i)) for i in sorted(set(layer_ids))]
    model = target if top_k else decoder  # the whole model for logits as generation computes them (soft-capping)
    try:
        with torch.autocast(input_ids.device.type, enabled=False):
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _StopAfterLastTappedLayer:
        outputs = None
    finally:
        for handle in handles:
            handle.remove()
    final = len(layers) - 1
    if final in captured:  # transformers returns the final layer's hidden state after the decoder's final norm
        captured[final] = decoder.norm(captured[final])
    features = TargetFeatures(torch.cat([captured[i] for i in layer_ids], dim=-1))
    if top_k:
        features.top_probs, features.top_ids = outputs.logits.float().softmax(-1).topk(top_k, dim=-1)  # [B, T, K]
    return features


def dataset_fingerprint(dataset) -> str:
    """Hash of every example's token ids: a store is only valid for exactly the data it was built from."""
    digest = hashlib.sha256()
    for ids in dataset["input_ids"]:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


def target_signature(target) -> str:
    """Hash of the target's weights (the first `SIGNATURE_VALUES` of each, in bf16, so that the dtype a target is
    loaded in does not matter): a store is only valid for the target that computed it."""
    digest = hashlib.sha256()
    for name, weight in target.state_dict().items():
        sample = weight.detach().flatten()[:SIGNATURE_VALUES].to("cpu", torch.bfloat16)
        digest.update(name.encode() + sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


class FeatureStore:
    """fp16 target features of a training set: `features.bin` (all examples back to back) and `index.json`; a store
    with soft targets (`top_k` > 0) adds the target's likeliest next tokens, `top_ids.bin` (int32) and `top_probs.bin`
    (fp16)."""

    def __init__(self, directory: str):
        index_path = os.path.join(directory, "index.json")
        if not os.path.exists(index_path):
            raise FileNotFoundError(
                f"no feature store in {directory} (missing index.json): run `domino-spec cache-features`"
            )
        with open(index_path, encoding="utf-8") as file:
            self.index = json.load(file)
        if "target" not in self.index:  # nothing to check a run's target against
            raise ValueError(
                f"the feature store in {directory} records no target: recompute it with `domino-spec cache-features`, "
                "into another --output"
            )
        if not self.index.get("complete"):
            raise ValueError(
                f"the feature store in {directory} is incomplete: rerun `domino-spec cache-features` to finish it"
            )
        self.directory = directory
        self.layer_ids = self.index["layer_ids"]
        self.width = self.index["width"]
        self.offsets = self.index["offsets"]
        self.top_k = self.index.get("top_k", 0)
        self.features = self._read("features.bin", self.width)
        if self.top_k:
            self.top_ids, self.top_probs = (
                self._read("top_ids.bin", self.top_k),
                self._read("top_probs.bin", self.top_k),
            )

    def _read(self, name: str, width: int) -> np.memmap:
        shape = (self.offsets[-1], width)
        return np.memmap(os.path.join(self.directory, name), dtype=STORE_DTYPES[name], mode="r", shape=shape)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, example: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.features[self.offsets[example] : self.offsets[example + 1]]))

    def soft_targets(self, example: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's `top_k` likeliest tokens after each position of `example` and their probabilities, `[T, top_k]`
        each (a store of more keeps the likeliest)."""
        rows = slice(self.offsets[example], self.offsets[example + 1])
        ids = torch.from_numpy(np.array(self.top_ids[rows, :top_k])).long()
        return ids, torch.from_numpy(np.array(self.top_probs[rows, :top_k]))

    def check(self, dataset, layer_ids: list[int], target, top_k: int = 0) -> None:
        """Raise `ValueError` unless this store was built by `target` from `dataset` with these tapped layers, and
        holds soft targets of at least `top_k` tokens.

        A rebuild goes into another folder: `build` refuses to overwrite a store that runs may have trained on.
        """
        if list(layer_ids) != self.layer_ids:
            stored = ",".join(str(layer) for layer in self.layer_ids)
            raise ValueError(
                f"the feature store in {self.directory} taps target layers {self.layer_ids}, the draft "
                f"{list(layer_ids)}: rebuild it with `domino-spec cache-features` and the same shape flags as train "
                f"(or --init_from the draft), into another --output, or pass --target_layer_ids {stored} to train "
                "(a fresh draft: not with --init_from)"
            )
        if self.index["fingerprint"] != dataset_fingerprint(dataset):
            raise ValueError(
                f"the feature store in {self.directory} was built from other training data: pass train the --data "
                "it was built from, or rebuild it for this --data with `domino-spec cache-features`, into another "
                "--output"
            )
        if self.index["target"] != target_signature(target):
            raise ValueError(
                f"the feature store in {self.directory} was built by another target (or other weights of it): pass "
                "train the --target it was built by, or rebuild it for this --target with "
                "`domino-spec cache-features`, into another --output"
            )
        if top_k > self.top_k:
            held = f"soft targets of {self.top_k} tokens" if self.top_k else "no soft targets"
            fix = f"pass train --soft_targets {self.top_k} or less" if self.top_k else "train without --soft_targets"
            raise ValueError(
                f"the feature store in {self.directory} holds {held}, training asks for {top_k}: {fix}, or rebuild "
                f"the store with `domino-spec cache-features --soft_targets {top_k}`, into another --output"
            )

    @staticmethod
    def build(
        target, dataset, layer_ids: list[int], directory: str, top_k: int = 0, extends: str | None = None
    ) -> "FeatureStore":
        """Compute and write the features of every example (with `top_k`, soft targets of that many tokens too);
        resumes an interrupted build where it stopped. `extends`, a complete store of the first examples of
        `dataset` (the same data before more was added), is copied and only the examples after them are computed."""
        os.makedirs(directory, exist_ok=True)
        index_path = os.path.join(directory, "index.json")
        identity = {"layer_ids": list(layer_ids), "fingerprint": dataset_fingerprint(dataset)}
        identity["target"] = target_signature(target)
        identity.update({"top_k": top_k} if top_k else {})
        if extends and not os.path.exists(index_path):
            _copy_prefix_store(extends, dataset, identity, directory)
        index = _resumable_index(index_path, identity, directory)
        done = len(index["offsets"]) - 1
        widths = {"features.bin": index.get("width", 0)}
        widths.update({"top_ids.bin": top_k, "top_probs.bin": top_k} if top_k else {})
        with contextlib.ExitStack() as stack:
            outputs = {name: stack.enter_context(open(os.path.join(directory, name), "ab")) for name in widths}
            for name, width in widths.items():  # the bytes the index counts
                outputs[name].truncate(index["offsets"][-1] * width * np.dtype(STORE_DTYPES[name]).itemsize)
            for example in tqdm(range(done, len(dataset)), initial=done, total=len(dataset), desc="target features"):
                input_ids = torch.tensor([dataset[example]["input_ids"]], device=target.device)
                computed = target_features(target, input_ids, None, layer_ids, top_k)
                features = computed.hidden[0].to(torch.float16).cpu()
                if not torch.isfinite(features).all():
                    raise ValueError(
                        f"example {example}: target features beyond fp16's range (|h| > 65504) at layers {layer_ids}; "
                        "train with online features (no --features), or tap other layers"
                    )
                index["width"] = features.shape[-1]
                rows = {"features.bin": features}
                rows.update(
                    {"top_ids.bin": computed.top_ids[0], "top_probs.bin": computed.top_probs[0]} if top_k else {}
                )
                for name, values in rows.items():
                    outputs[name].write(values.cpu().numpy().astype(STORE_DTYPES[name]).tobytes())
                index["offsets"].append(index["offsets"][-1] + features.shape[0])
                if example % 50 == 0 or example == len(dataset) - 1:
                    _sync(outputs.values())  # on disk before the index that counts them
                    _write_json(index_path, index)
            index["complete"] = True
            _sync(outputs.values())
        _write_json(index_path, index)
        return FeatureStore(directory)


def _copy_prefix_store(source: str, dataset, identity: dict, directory: str) -> None:
    """Start the store of `identity` in `directory` from the complete store `source` of a prefix of `dataset`:
    its files, and an index of that prefix under the new identity (written last, so an interrupted copy redoes it)."""
    store = FeatureStore(source)
    wanted = {"layer_ids": identity["layer_ids"], "target": identity["target"], "top_k": identity.get("top_k", 0)}
    stored = {"layer_ids": store.layer_ids, "target": store.index["target"], "top_k": store.top_k}
    prefix = dataset.select(range(min(len(store), len(dataset))))
    if len(store) > len(dataset) or store.index["fingerprint"] != dataset_fingerprint(prefix):
        stored["data"] = "other examples"
        wanted["data"] = f"the first {len(store)} of --data"
    differences = [f"{key} {stored[key]}, not {wanted[key]}" for key in wanted if stored.get(key) != wanted[key]]
    if differences:
        raise ValueError(
            f"--extend {source} is not a store of the start of this data with the same layers and target "
            f"({'; '.join(differences)}): pass a store built from the first examples of --data (the data before "
            "more pieces were added), or build this store from scratch without --extend"
        )
    print(f"copying the features of the first {len(store)} examples from {source}")
    for name in STORE_DTYPES if store.top_k else ["features.bin"]:
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    _write_json(
        os.path.join(directory, "index.json"),
        {**identity, "offsets": store.offsets, "width": store.width, "complete": False},
    )


def _resumable_index(index_path: str, identity: dict, directory: str) -> dict:
    """The index of a build of `identity`: the one in `index_path` when it is of the same store (to resume it),
    else a fresh one. An index of another store raises `ValueError` rather than being overwritten: runs trained on
    that store (`train --features`) check it when they resume, and would be refused."""
    if not os.path.exists(index_path):
        return {**identity, "offsets": [0], "complete": False}
    with open(index_path, encoding="utf-8") as file:
        previous = json.load(file)
    differences = []
    if previous.get("layer_ids") != identity["layer_ids"]:
        differences.append(f"target layers {previous.get('layer_ids')}, not {identity['layer_ids']}")
    if previous.get("fingerprint") != identity["fingerprint"]:
        differences.append("other training data")
    if previous.get("top_k", 0) != identity.get("top_k", 0):
        differences.append(f"soft targets of {previous.get('top_k', 0)} tokens, not {identity.get('top_k', 0)}")
    if previous.get("target") != identity["target"]:
        differences.append(
            "another target (or other weights of it)" if "target" in previous else "an unrecorded target"
        )
    if differences:
        store = "a feature store" if previous.get("complete") else "an unfinished feature store"
        raise ValueError(
            f"{directory} holds {store} of {'; '.join(differences)}: building this one there would discard it, and "
            f"runs trained on it could not resume; pass another --output, or delete {directory} if nothing uses it"
        )
    return previous


def _sync(files) -> None:
    for file in files:
        file.flush()
        os.fsync(file.fileno())


def _write_json(path: str, value: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        json.dump(value, file)
    os.replace(path + ".tmp", path)
