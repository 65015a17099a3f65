"""DominoTrainer: `transformers.Trainer` with a frozen target (features online or from a store) and the Domino loss."""

import contextlib
import functools
import logging
import os
import signal
import threading
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME

from .collator import DominoDataCollator, sample_anchors, seeded_generator
from .features import TargetFeatures, target_features
from .loss import IGNORE_INDEX, block_labels, block_soft_targets, curriculum_lambda, domino_loss
from .model_card import training_summary, write_model_card

logger = logging.getLogger(__name__)

# The folder inside a save's destination that the save is written to before its files move into place.
PARTIAL_SAVE = ".partial-save"


@dataclass
class DominoTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the Domino recipe. Defaults follow the published recipe (AdamW, lr 6e-4, cosine,
    warmup 4%, grad clip 1.0, lambda 1 -> 0 over the whole run)."""

    lambda_start: float = field(
        default=1.0, metadata={"help": "Base-loss weight at step 0 (0 disables the curriculum)."}
    )
    decay_ratio: float = field(default=1.0, metadata={"help": "Fraction of the steps over which lambda falls to 0."})
    num_anchors: int = field(
        default=256,
        metadata={
            "help": "Blocks trained per sequence (the published GPU recipe's 256). A step's cost grows with batch x "
            "anchors x block size x draft vocabulary: on a CPU lower it, e.g. --num_anchors 32 "
            "--per_device_train_batch_size 2 --draft_vocab_size 8192 (the SmolLM2 recipe, under a second a step)."
        },
    )
    loss_gamma: float = field(default=7.0, metadata={"help": "Position weights exp(-k / gamma)."})
    soft_targets: int = field(
        default=0,
        metadata={
            "help": "Train on the target's distribution instead of its tokens: the probabilities of its K likeliest "
            "next tokens, renormalised over the draft vocabulary (0: its tokens). With --features, the store must "
            "hold them: `domino-spec cache-features --soft_targets K`."
        },
    )
    training_time_test: bool = field(
        default=False, metadata={"help": "The GRU reads the draft's own predictions instead of the ground truth."}
    )
    learning_rate: float = field(default=6e-4, metadata={"help": "AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=0.04, metadata={"help": "Warmup steps, or a fraction of all steps if < 1."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the collator's columns are all used by compute_loss."}
    )
    restart: bool = field(
        default=False,
        metadata={"help": "Start from step 0 even if output_dir holds checkpoints (default: resume from the last)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.label_smoothing_factor:
            raise ValueError("label_smoothing_factor: the Domino loss has no label smoothing; leave it at 0.")
        if self.soft_targets < 0:
            raise ValueError(f"--soft_targets {self.soft_targets}: a number of tokens, or 0 for the target's tokens.")


class StopOnSignal(TrainerCallback):
    """SIGTERM (a scheduler's stop) or Ctrl-C during training: save a checkpoint at the end of the current step and
    stop, so that rerunning the same command resumes there (`domino-spec train` resumes from the last checkpoint).
    A second Ctrl-C interrupts at once; a second SIGTERM is the same request (a launcher forwards the job's SIGTERM to
    workers that got it already), and DataLoader workers ignore both, leaving the stop to the training process.
    With several processes, all stop at the same step, whichever got the signal; `received` then names it in every
    process."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: signal.Signals | None = None
        self._previous_handlers = {}

    def _receive(self, number, frame) -> None:
        self.received = signal.Signals(number)
        if number == signal.SIGINT:
            signal.signal(number, self._previous_handlers[number])

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():  # Python sets signal handlers there only
            self._previous_handlers = {number: signal.signal(number, self._receive) for number in self.SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        number = 0 if self.received is None else self.received.value
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every process stops at the same step for the signal any one of them got (a process that went on would
            # wait forever in the next step's all-reduce, and one that finished would save a "final" draft).
            flag = torch.tensor(number, device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            number = int(flag.item())
        if number:
            self.received = signal.Signals(number)
            logger.warning("%s: saving a checkpoint at step %d and stopping", self.received.name, state.global_step)
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.restore_handlers()

    def restore_handlers(self) -> None:
        """Put back the handlers `on_train_begin` replaced (also when training raised, before `on_train_end`)."""
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}


class MetricMeans:
    """Per-batch metrics summed since the last `pop_means`, which averages them over batches and processes."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += 1

    def pop_means(self, accelerator, device) -> dict[str, float]:
        """The means, reset after; every process must call it (an all-reduce), and all must have added batches."""
        if not self.count:
            return {}
        names = sorted(self.sums)
        means = torch.tensor([self.sums[name] / self.count for name in names], device=device)
        means = accelerator.reduce(means, reduction="mean")
        self.sums, self.count = {}, 0
        return {name: round(value, 4) for name, value in zip(names, means.tolist())}


def _torch_dataloader(dataloader):
    """The torch DataLoader of what Trainer hands out: accelerate's wrapper, or the DataLoader itself."""
    return getattr(dataloader, "base_dataloader", dataloader)


def _workers_ignoring_stop_signals(dataloader):
    """`dataloader` (accelerate's wrapper or a torch DataLoader), its workers set to ignore stop signals."""
    loader = _torch_dataloader(dataloader)
    init = loader.worker_init_fn
    if getattr(init, "func", None) is not _ignore_stop_signals:  # Trainer may hand back a loader it cached
        loader.worker_init_fn = functools.partial(_ignore_stop_signals, init)
    return dataloader


def _with_training_collator(dataloader, args: DominoTrainingArguments, draw_anchors: bool):
    """`dataloader`, its `DominoDataCollator` set by the arguments (one setting: theirs): drawing their number of
    anchors from the seed and each batch instead of torch's global generator, or none (`draw_anchors` False), and
    bringing the stored soft targets they train on."""
    loader = _torch_dataloader(dataloader)
    if isinstance(loader.collate_fn, DominoDataCollator):
        loader.collate_fn = replace(
            loader.collate_fn,
            num_anchors=args.num_anchors,
            anchor_seed=args.seed,
            draw_anchors=draw_anchors,
            soft_targets=args.soft_targets,
        )
    return dataloader


def _ignore_stop_signals(worker_init_fn, worker_id: int) -> None:
    """A DataLoader worker's start: a signal sent to the whole process group (scheduler, Ctrl-C) is the training
    process's to handle; a worker killed by it would crash the step that should save the checkpoint."""
    for number in StopOnSignal.SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def move_into_place(partial: str, folder: str) -> None:
    """Move the files of the save `partial` into `folder` and remove it: the weights last, and the weights they replace
    first. At any kill, `folder` holds either no weights or complete ones, with every other file of their save."""
    weights = [name for name in os.listdir(partial) if name.endswith(".safetensors")]
    for name in weights:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    for name in sorted(os.listdir(partial), key=lambda name: name in weights):
        os.replace(os.path.join(partial, name), os.path.join(folder, name))
    os.rmdir(partial)


class DominoTrainer(Trainer):
    """Trains a `DominoDraftModel` (`model`) against a frozen `target`.

    The target stays outside `Trainer.model`: it is not optimised, not checkpointed and not wrapped by
    DDP/FSDP; it is moved to the training device here. Each step computes its tapped hidden states with
    no grad, then `loss = lam * CE(base) + (1 - lam) * CE(final)` with `lam` from `curriculum_lambda`.
    Every checkpoint is a loadable draft folder (weights, config, model code). SIGTERM or Ctrl-C saves one and
    stops (`stop_on_signal.received` then names the signal).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        target: PreTrainedModel,
        args: DominoTrainingArguments,
        data_summary: dict | None = None,
        **kwargs,
    ):
        if args.remove_unused_columns:
            raise ValueError("DominoTrainer needs remove_unused_columns=False (anchors and loss masks are inputs).")
        model.check_target(target)
        super().__init__(model=model, args=args, **kwargs)
        self.target = target.to(self.args.device).eval().requires_grad_(False)
        self.data_summary = data_summary  # for the model card: `data.summarize`, with `generation_settings`
        self._train_metrics, self._eval_metrics = MetricMeans(), MetricMeans()
        self.stop_on_signal = StopOnSignal()
        self.add_callback(self.stop_on_signal)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # a run that raised never reached on_train_end: a later SIGTERM must not be swallowed
            self.stop_on_signal.restore_handlers()

    def load_finished_run(self, checkpoint: str) -> None:
        """The state and final weights of the run that ended at `checkpoint` (under `load_best_model_at_end`, the
        best checkpoint's weights), as its training left them: to save its final draft again."""
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        best = self.state.best_model_checkpoint
        self._load_from_checkpoint(best if self.args.load_best_model_at_end and best else checkpoint)

    def get_train_dataloader(self):
        """Trainer's, with workers that leave stop signals to training and a collator that draws no anchors:
        `training_step` draws the ones trained on, which depend on the step, which the collator does not know."""
        dataloader = _workers_ignoring_stop_signals(super().get_train_dataloader())
        return _with_training_collator(dataloader, self.args, draw_anchors=False)

    def get_eval_dataloader(self, eval_dataset=None):
        """Trainer's, with workers that leave stop signals to training and anchors fixed by the seed and each batch
        (not drawn from the training stream): scores of successive evaluations compare."""
        dataloader = _workers_ignoring_stop_signals(super().get_eval_dataloader(eval_dataset))
        return _with_training_collator(dataloader, self.args, draw_anchors=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step, on anchors drawn here from the seed, the step and each example's tokens: a run resumed in
        the middle of an epoch trains on the blocks the uninterrupted run trained on (what a generator had drawn
        before the step is not restored: Trainer skips the trained batches, DataLoader workers seed their own).
        Anchors a batch already holds are replaced."""
        rows = zip(inputs["input_ids"].cpu(), inputs["attention_mask"].cpu().bool())
        generators = [seeded_generator(self.args.seed, self.state.global_step, ids[mask]) for ids, mask in rows]
        anchors = sample_anchors(inputs["loss_mask"].cpu(), self.args.num_anchors, generators)
        inputs = {**inputs, "anchor_positions": anchors.to(inputs["input_ids"].device)}
        return super().training_step(model, inputs, num_items_in_batch)

    def current_lambda(self) -> float:
        return curriculum_lambda(
            self.state.global_step, self.state.max_steps, self.args.lambda_start, self.args.decay_ratio
        )

    def target_features(self, inputs: dict[str, torch.Tensor]) -> TargetFeatures:
        """The batch's target features: from the feature store when the collator brought them, else computed (the
        target stops after the last tapped layer unless soft targets need its logits)."""
        if "target_hidden" in inputs:
            return TargetFeatures(inputs["target_hidden"], inputs.get("target_top_ids"), inputs.get("target_top_probs"))
        layer_ids = self.accelerator.unwrap_model(self.model).config.target_layer_ids
        return target_features(
            self.target, inputs["input_ids"], inputs["attention_mask"], layer_ids, self.args.soft_targets
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        features = self.target_features(inputs)
        outputs = model(
            input_ids=inputs["input_ids"],
            target_hidden=features.hidden,
            anchor_positions=inputs["anchor_positions"],
            embed_tokens=self.target.get_input_embeddings(),
            lm_head=self.target.get_output_embeddings(),
            attention_mask=inputs["attention_mask"],
            head_reads_predictions=self.args.training_time_test,
        )
        labels = block_labels(
            inputs["input_ids"], inputs["loss_mask"], inputs["anchor_positions"], outputs.logits.shape[2]
        )
        # The draft's logits cover its draft vocabulary: labels as its indices, tokens it cannot propose ignored.
        to_draft_vocab = self.accelerator.unwrap_model(model).to_draft_vocab
        labels = to_draft_vocab(labels, IGNORE_INDEX)
        soft_targets = None
        if self.args.soft_targets:
            top_ids, top_probs = block_soft_targets(
                features.top_ids, features.top_probs, inputs["anchor_positions"], outputs.logits.shape[2]
            )
            soft_targets = (to_draft_vocab(top_ids, IGNORE_INDEX), top_probs)
        loss, metrics = domino_loss(
            outputs.logits, outputs.base_logits, labels, self.current_lambda(), self.args.loss_gamma, soft_targets
        )
        (self._train_metrics if model.training else self._eval_metrics).add(metrics)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation scores the training loss (its metrics go to `evaluation_loop`); the draft has no predictions
        or labels for Trainer to gather."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """Trainer's loop (`eval_loss`), plus the Domino metrics of the evaluated batches: `eval_loss_base`,
        `eval_acceptance_final`, ... These are means over batches, then over processes, including the examples
        accelerate repeats to even out the processes' batches, which Trainer drops from `eval_loss`: with several
        processes the two can differ slightly."""
        self._eval_metrics = MetricMeans()
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        means = self._eval_metrics.pop_means(self.accelerator, self.args.device)
        output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in means.items()})
        return output

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Adds the Domino metrics, averaged since the last log and over processes (as the loss), to the logs."""
        if "loss" in logs:  # every process logs the loss: all reduce together
            logs.update(self._train_metrics.pop_means(self.accelerator, self.args.device))
        super().log(logs, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save, plus the model card (`README.md`) and `training_summary.json` of the folder, written into
        a folder inside it, then moved into place (`move_into_place`): a kill mid-save leaves no truncated weights."""
        output_dir = output_dir or self.args.output_dir
        partial = os.path.join(output_dir, PARTIAL_SAVE)
        super()._save(partial, state_dict)
        if not self.args.should_save:  # transformers 5.24 calls _save on every process; one writes
            return
        try:
            write_model_card(partial, training=training_summary(self.args, self.state, self.data_summary))
        except Exception as error:  # the weights are saved; a card problem must not stop a long run
            logger.warning("could not write the model card into %s: %s", output_dir, error)
        move_into_place(partial, output_dir)
