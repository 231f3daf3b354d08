"""Training the retaining heads on a frozen backbone, from start (or a checkpoint) to a heads GGUF.

One step is one sequence: the backbone's forward pass gives every layer's head input and labels
(backbone.py, labels.py), every head predicts its layer's scores, and the loss is the mean over
layers of SmoothL1 + alpha * smoothness (heads_model.py), plus --rank-weight's attention KL when asked.
AdamW with the paper's betas, linear warmup then cosine decay to a tenth of the peak rate, gradients
clipped. With --query-tokens the examples take Locret-Q's layout (training_data.with_query) and the
labels are gathered over every prompt token as always, the query's included.

The run folder holds everything a run leaves: `checkpoint.pt` (written every --checkpoint-every
steps and when the run stops, so a killed or time-limited run resumes where it was),
`heads.safetensors` (the published checkpoint format, Hugging Face Q/K order, with the recipe in
its metadata), `train-log.json` (settings and one record per step) and `loss.png`. The heads GGUF
is then written through the converter, exactly as a published checkpoint would be.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .backbone import Backbone, load_backbone
from ..convert.base_model import BaseModel, read_base_model
from ..convert.checkpoint import is_heads_gguf, read_checkpoint
from ..convert.conversion import ConversionRequest, convert, refuse_bad_output
from ..convert.errors import ConversionError
from ..convert.gguf_output import Recommended
from ..convert.heads import check_layout, load_layer
from .heads_model import RetainingHeads, head_loss, top_overlap
from .synthetic import DEFAULT_CONTEXTS, DEFAULT_TASKS, TEACHER_TASKS, TEACHER_TOKENS, SyntheticData, mix_problem
from .. import holdout
from .training_data import Example, TokenizedExample, read_examples, render_prompt, tokenize, with_query

BETAS = (0.9, 0.95)
FINAL_LR_FRACTION = 0.1
LOG_VERSION = 1


@dataclass
class TrainConfig:
    base: str                    # backbone: a model GGUF or a Hugging Face model directory
    gguf: str                    # the model GGUF the heads are for (the base itself when it is a GGUF)
    output: str                  # heads GGUF to write
    run_dir: str
    data: list[str] = field(default_factory=list)  # local SFT files; empty: the built-in generator
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    d_r: int = 256
    steps: int = 600
    lr: float = 5e-4
    warmup_steps: int = 30
    grad_clip: float = 0.5
    min_tokens: int = 512
    max_tokens: int = 2048
    seed: int = 0
    checkpoint_every: int = 25
    weight_type: str = "f16"
    budget: int = 2048
    chunk: int = 512
    stabilizers: int = 128
    local: int = 100
    init_heads: str = ""         # heads.safetensors to start from (fine-tuning); empty: a seeded random init
    freeze_layers: list[int] = field(default_factory=list)  # layers kept as init_heads gave them
    rank_weight: float = 0.0     # weight of heads_model.attention_kl in the loss; 0: the paper's loss alone
    query_tokens: int = 0        # Locret-Q: the query's length limit L_Q, placed in front of the prompt; 0: off
    contexts: list[str] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))  # built-in generator's text kinds

    def fingerprint(self) -> str:
        """What must not change between a run and its resumption."""
        keys = ("base", "data", "tasks", "d_r", "steps", "lr", "warmup_steps", "grad_clip", "min_tokens",
                "max_tokens", "seed", "init_heads")
        settings = {k: getattr(self, k) for k in keys}
        if self.freeze_layers:  # only when used, so that runs from before the option still resume
            settings["freeze_layers"] = sorted(self.freeze_layers)
        if self.rank_weight:  # likewise
            settings["rank_weight"] = self.rank_weight
        if self.query_tokens:  # likewise
            settings["query_tokens"] = self.query_tokens
        if self.contexts != list(DEFAULT_CONTEXTS):  # likewise
            settings["contexts"] = list(self.contexts)
        text = json.dumps(settings, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_config(config: TrainConfig) -> None:
    """Refuse impossible settings before loading anything."""
    if config.d_r <= 0:
        raise ConversionError(f"--d-r must be positive, got {config.d_r}")
    if config.steps <= 0:
        raise ConversionError(f"--steps must be positive, got {config.steps}")
    if not config.lr > 0:
        raise ConversionError(f"--lr must be positive, got {config.lr}")
    if not 0 <= config.warmup_steps < config.steps:
        raise ConversionError(f"--warmup-steps must be in [0, --steps), got {config.warmup_steps}")
    if not 16 <= config.min_tokens <= config.max_tokens:
        raise ConversionError(f"need 16 <= --min-tokens <= --max-tokens (got {config.min_tokens}, {config.max_tokens})")
    if config.checkpoint_every <= 0:
        raise ConversionError(f"--checkpoint-every must be positive, got {config.checkpoint_every}")
    if config.query_tokens < 0:
        raise ConversionError(f"--query-tokens must be >= 0 (0: no Locret-Q query), got {config.query_tokens}")
    problem = mix_problem(config.tasks, config.contexts)
    if problem:
        raise ConversionError(problem)
    output = Path(config.output)
    refuse_bad_output(output, [resolve_model(config.gguf)])
    for path in config.data:
        if not Path(path).is_file():
            raise ConversionError(f"training data {path}: no such file")
        held_out = holdout.why_not_training_data(path)
        if held_out:
            raise ConversionError(f"training data {held_out}: heads must never learn from it")
    if config.init_heads and not Path(config.init_heads).exists():
        raise ConversionError(f"--init-heads {config.init_heads}: no such file or directory")
    if not (math.isfinite(config.rank_weight) and config.rank_weight >= 0):
        raise ConversionError(f"--rank-weight must be a finite number >= 0, got {config.rank_weight}")
    if config.freeze_layers and not config.init_heads:
        raise ConversionError("--freeze-layers keeps layers as --init-heads gives them; without --init-heads they "
                              "would stay random")


def resolve_model(text: str) -> Path:
    """A path as given, or a model name that the locret package knows (`locret models list`)."""
    path = Path(text)
    if path.exists() or "/" in text or text.endswith(".gguf"):
        return path
    try:
        from locret import models
    except ImportError:
        return path
    if text not in models.MODELS:
        return path
    try:
        return Path(models.resolve(text))
    except models.ModelFileError as e:
        raise ConversionError(f"model {text}: {e}") from None


class ExampleSource:
    """Example for step `i`: the built-in generator's #i, or the user's records in a seeded shuffled order."""

    def __init__(self, config: TrainConfig, backbone: Backbone) -> None:
        self.config = config
        self.tokenizer = backbone.tokenizer
        self.backbone = backbone
        self.records = [e for path in config.data for e in read_examples(Path(path))]
        self.synthetic = None
        if not self.records:
            taught = any(t in TEACHER_TASKS for t in config.tasks)
            self.synthetic = SyntheticData(lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)),
                                           config.seed, config.min_tokens, config.max_tokens, tuple(config.tasks),
                                           tuple(config.contexts), teacher=self.teacher if taught else None)
        self.order: list[int] = []

    def teacher(self, prompt: str) -> str:
        """The backbone's own greedy answer (full attention) to a prompt of one user turn, rendered as the labels
        will read it (without Locret-Q's layout: the teacher answers the prompt as a user would send it)."""
        ids = render_prompt(self.tokenizer, (("user", prompt),))
        return self.tokenizer.decode(self.backbone.greedy(ids, TEACHER_TOKENS), skip_special_tokens=True)

    def corpora(self) -> list[dict]:
        """The real-text corpora the built-in generator reads ([] for data files or generated text only)."""
        if self.synthetic is None:
            return []
        from ..tasks import realtext
        from ..tasks.realtext import corpus as corpus_module

        out = []
        for family in dict.fromkeys(self.config.contexts):      # a kind named twice is one corpus
            if family in realtext.TRAINING_FAMILIES:
                c = realtext.load(family)
                files = corpus_module.manifest(c)         # read from the cache file once
                listing = json.dumps(files, sort_keys=True).encode()
                out.append({"family": family, "id": c.id, "files": len(files),
                            "manifest_sha256": hashlib.sha256(listing).hexdigest()})
        return out

    def describe(self) -> str:
        if self.synthetic is not None:
            kinds = ("pydoc_data.topics text" if self.config.contexts == list(DEFAULT_CONTEXTS) else
                     f"text drawn from {', '.join(self.config.contexts)}")
            text = (f"built-in generator ({kinds}; tasks {', '.join(self.config.tasks)}; "
                    f"{self.config.min_tokens}-{self.config.max_tokens} tokens; seed {self.config.seed})")
            taught = [t for t in dict.fromkeys(self.config.tasks) if t in TEACHER_TASKS]
            if taught:
                text += (f"; the answers of {', '.join(taught)}: the backbone's own greedy answers with full "
                         f"attention, at most {TEACHER_TOKENS} tokens")
        else:
            text = f"{len(self.records)} records from {', '.join(Path(p).name for p in self.config.data)}"
        if self.config.query_tokens:  # the heads expect this layout at inference, so their recipe says so
            text += (f"; Locret-Q layout: the query (at most {self.config.query_tokens} tokens) before the first "
                     f"user turn")
        return text

    def example(self, step: int) -> tuple[Example, str]:
        """Example `step` as text, in Locret-Q's layout when asked, and its task."""
        if self.synthetic is not None:
            ex = self.synthetic.example(step)
            example = Example(messages=(("user", ex.prompt),), answer=ex.answer, where=f"built-in #{step}")
            question, task = ex.question, ex.task
        else:
            epoch, index = divmod(step, len(self.records))
            order = list(range(len(self.records)))
            random.Random(f"{self.config.seed}:epoch{epoch}").shuffle(order)
            example, question, task = self.records[order[index]], None, "data"
        if self.config.query_tokens:
            example = with_query(self.tokenizer, example, self.config.query_tokens, question)
        return example, task

    def get(self, step: int) -> tuple[TokenizedExample, str]:
        example, task = self.example(step)
        return tokenize(self.tokenizer, example, self.config.max_tokens), task


def load_init_heads(heads: RetainingHeads, path: Path, base: BaseModel) -> None:
    """Start from trained heads: any checkpoint the converter reads (this trainer's heads.safetensors, a
    published Locret checkpoint file or directory), checked against the base model by the converter's own
    layout check; biases and another d_R are refused (the trained heads have neither)."""
    checkpoint = read_checkpoint(path)
    layout = check_layout(checkpoint, base)
    if layout.has_fc1_bias or layout.has_fc2_bias:
        raise ConversionError(f"--init-heads {path}: heads with biases cannot be trained here (the trainer's heads "
                              f"have none)")
    if layout.d_r != heads.d_r:
        raise ConversionError(f"--init-heads {path}: its heads have d_R {layout.d_r}, this run's --d-r is {heads.d_r}")
    for layer in range(base.n_layer):
        weights = load_layer(checkpoint, layout, layer, fc1_column_order=None)  # Hugging Face Q/K order, as trained
        heads.set_layer(layer, torch.from_numpy(weights.fc1_weight), torch.from_numpy(weights.fc2_weight))


def freeze(heads: RetainingHeads, layers: list[int]) -> list[torch.nn.Parameter]:
    """Stop gradients to the given layers' heads; the parameters left to train. Every layer still counts in
    the loss and the log, so a run's figures compare with an unfrozen run's."""
    n_layer = len(heads.fc1)
    outside = sorted(set(l for l in layers if not 0 <= l < n_layer))
    if outside:
        raise ConversionError(f"--freeze-layers {outside}: the model has layers 0-{n_layer - 1}")
    if len(set(layers)) == n_layer:
        raise ConversionError("--freeze-layers names every layer: nothing would be trained")
    trainable = []
    for layer in range(n_layer):
        for param in (heads.fc1[layer], heads.fc2[layer]):
            param.requires_grad_(layer not in layers)
            if layer not in layers:
                trainable.append(param)
    return trainable


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine from lr down to FINAL_LR_FRACTION * lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(heads: RetainingHeads, optimizer: torch.optim.Optimizer, inputs: list[torch.Tensor],
               labels: torch.Tensor, grad_clip: float, rank_weight: float = 0.0) -> tuple[float, list[float]]:
    """One optimizer step on one sequence; returns the loss averaged over layers and each layer's top-10 % overlap
    accuracy (a model whose runtime evicts only some layers, Gemma-3's full-attention ones, is judged by those)."""
    optimizer.zero_grad(set_to_none=True)
    losses, accuracy = [], []
    for layer, x in enumerate(inputs):
        pred = heads.layer_scores(layer, x)
        losses.append(head_loss(pred, labels[layer], rank_weight))
        accuracy.append(top_overlap(pred.detach(), labels[layer]))
    loss = torch.stack(losses).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(heads.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach()), accuracy


def check_backbone_matches_gguf(backbone: Backbone, gguf: Path) -> BaseModel:
    """The GGUF's model, refused unless it is the backbone's; returned for the heads' own checks."""
    model = read_base_model(gguf)
    ours = (backbone.gguf_architecture, backbone.n_layer, backbone.n_head, backbone.n_head_kv, backbone.head_dim)
    theirs = (model.architecture, model.n_layer, model.n_head, model.n_head_kv, model.head_dim_k)
    if ours != theirs:
        raise ConversionError(f"the backbone {backbone.source} (arch, layers, heads, kv heads, head size = {ours}) "
                              f"is not the model of {gguf} ({theirs})")
    return model


def train(config: TrainConfig, resume: bool = True, max_minutes: float | None = None, threads: int | None = None,
          device: str = "cpu", stop_after_steps: int | None = None, command: str = "") -> dict:
    """Run (or resume) training, then write heads.safetensors, the log, the plot and the heads GGUF.
    Returns the run summary that train-log.json also holds."""
    check_config(config)
    started = time.monotonic()
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)

    backbone = load_backbone(resolve_model(config.base), threads=threads, device=device)
    base = check_backbone_matches_gguf(backbone, resolve_model(config.gguf))
    source = ExampleSource(config, backbone)
    heads = RetainingHeads(backbone.n_layer, backbone.d_in, config.d_r, backbone.n_head_kv, backbone.activation,
                           config.seed).to(backbone.device)
    if config.init_heads:
        load_init_heads(heads, Path(config.init_heads), base)
    trainable = freeze(heads, config.freeze_layers)
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=BETAS, weight_decay=0.0)

    checkpoint_path = run_dir / "checkpoint.pt"
    log: list[dict] = []
    step, elapsed_before = 0, 0.0
    if resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location=backbone.device, weights_only=False)
        if state.get("fingerprint") != config.fingerprint():
            raise ConversionError(f"{checkpoint_path} belongs to a run with other settings; use another --run-dir "
                                  f"or --no-resume to start over")
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, log, elapsed_before = state["step"], state["log"], state["elapsed_s"]
        print(f"resuming {run_dir} at step {step} of {config.steps}")

    def save_checkpoint() -> None:
        tmp = checkpoint_path.with_suffix(".tmp")
        torch.save({"fingerprint": config.fingerprint(), "step": step, "heads": heads.state_dict(),
                    "optimizer": optimizer.state_dict(), "log": log,
                    "elapsed_s": elapsed_before + time.monotonic() - started}, tmp)
        tmp.replace(checkpoint_path)

    deadline = started + max_minutes * 60 if max_minutes else None
    stop_at = min(config.steps, step + stop_after_steps) if stop_after_steps is not None else config.steps
    stopped_by_time = False
    smooth_loss = smooth_acc = None
    with tqdm(total=config.steps, initial=step, desc="training heads", unit="step") as bar:
        while step < config.steps:
            if deadline is not None and time.monotonic() >= deadline:
                stopped_by_time = True
                break
            if step >= stop_at:
                break
            t0 = time.monotonic()
            example, task = source.get(step)
            features = backbone.features(example.token_ids, example.n_prompt)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            loss, by_layer = train_step(heads, optimizer, features.inputs, features.labels, config.grad_clip,
                                        config.rank_weight)
            accuracy = sum(by_layer) / len(by_layer)
            if not math.isfinite(loss):
                raise ConversionError(f"the loss became {loss} at step {step} ({example.where}); lower --lr")
            log.append({"step": step, "loss": loss, "top10_accuracy": accuracy,
                        "top10_by_layer": [round(a, 4) for a in by_layer], "task": task,
                        "n_tokens": len(example.token_ids), "n_prompt": example.n_prompt,
                        "lr": learning_rate(config, step), "seconds": round(time.monotonic() - t0, 3)})
            step += 1
            smooth_loss = loss if smooth_loss is None else 0.9 * smooth_loss + 0.1 * loss
            smooth_acc = accuracy if smooth_acc is None else 0.9 * smooth_acc + 0.1 * accuracy
            bar.set_postfix(loss=f"{smooth_loss:.3f}", top10=f"{smooth_acc:.3f}", task=task)
            bar.update(1)
            if step % config.checkpoint_every == 0:
                save_checkpoint()
    save_checkpoint()
    if step < config.steps:
        why = "--max-minutes" if stopped_by_time else "--stop-after-steps"
        print(f"stopped by {why} at step {step} of {config.steps}; run again with the same settings to resume "
              f"(the heads written now are the partly trained ones)")

    summary = {
        "log_version": LOG_VERSION,
        "config": asdict(config),
        "command": command,
        "data": source.describe(),
        # every data file by path and content, so that an evaluation can tell what the heads learned from
        # (RULER's refuses heads whose log names its package's data: holdout.why_not_training_data)
        "sources": [{"path": str(p), "sha256": holdout.sha256_of(p)} for p in config.data],
        # the real text the built-in generator drew from: each corpus by its cache key and file count, with the
        # sha256 of its manifest (every file's name and sha256: locret.tasks.realtext.corpus.manifest)
        "corpora": source.corpora(),
        "backbone": {"source": str(config.base), "architecture": backbone.gguf_architecture,
                     "n_layer": backbone.n_layer, "n_head": backbone.n_head, "n_head_kv": backbone.n_head_kv,
                     "head_dim": backbone.head_dim},
        "steps_done": step,
        "finished": step >= config.steps,
        "train_seconds": round(elapsed_before + time.monotonic() - started, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": log,
    }
    (run_dir / "train-log.json").write_text(json.dumps(summary, indent=1))
    plot_loss(log, run_dir / "loss.png", title=f"Locret heads d_R {config.d_r}, seed {config.seed}",
              loss_name=f"SmoothL1 + smoothness + {config.rank_weight:g} rank" if config.rank_weight
              else "SmoothL1 + smoothness")
    export(heads, config, summary, run_dir)
    return summary


def export(heads: RetainingHeads, config: TrainConfig, summary: dict, run_dir: Path) -> Path:
    """heads.safetensors with the recipe in its metadata, then the heads GGUF through the converter."""
    checkpoint = run_dir / "heads.safetensors"
    recent = summary["steps"][-50:]
    metadata = {
        "locret.training.source": "locret trainer",
        "locret.training.seed": str(config.seed),
        "locret.training.steps": str(summary["steps_done"]),
        "locret.training.notes": (f"d_R {config.d_r}; data: {summary['data']}; lr {config.lr}, warmup "
                                  f"{config.warmup_steps}, grad clip {config.grad_clip}; final loss "
                                  f"{mean_of(recent, 'loss'):.4f}, top-10% accuracy {mean_of(recent, 'top10_accuracy'):.3f} "
                                  f"(mean of last {len(recent)} steps); command: {summary['command']}"),
    }
    save_file(heads.checkpoint_tensors(), checkpoint, metadata=metadata)
    carried = carried_recommendations(config.init_heads)
    if carried:
        print("recommended from the init heads, kept: " + ", ".join(f"{k} {v}" for k, v in carried.items()))
    convert(ConversionRequest(heads=checkpoint, out=Path(config.output), base=resolve_model(config.gguf), merge_into=None,
                              weight_type=config.weight_type, name=None, skip_qk_permutation=False,
                              recommended=Recommended(budget=config.budget, chunk=config.chunk,
                                                      stabilizers=config.stabilizers, local=config.local,
                                                      # Locret-Q heads: their tools find and pin the question
                                                      query="auto" if config.query_tokens else "",
                                                      **carried)))
    return Path(config.output)


def carried_recommendations(init_heads: str) -> dict:
    """What a fine-tune keeps of the settings its init heads recommend: their score pooling (window and threshold) and
    positions. The heads were measured with them, and `--pool auto` (the evaluation's, the tools') reads them from
    the file: without them a fine-tune of pooled heads would be measured unpooled beside its own start. An init from
    safetensors, or heads that recommend none, carry nothing."""
    if not init_heads or not is_heads_gguf(init_heads):
        return {}
    from locret.heads import file_recommended

    rec = file_recommended(init_heads) or {}
    carried = {"pool": rec.get("pool"), "pool_from": rec.get("pool_from"), "positions": rec.get("positions")}
    return {k: v for k, v in carried.items() if v}  # Recommended's fields; unset ones are not written


def accuracy_by_layer(records: list[dict]) -> list[float]:
    """Each layer's top-10 % accuracy averaged over the records that carry it (a log written before it was
    recorded has none: an empty list)."""
    rows = [r["top10_by_layer"] for r in records if "top10_by_layer" in r]
    return [sum(col) / len(rows) for col in zip(*rows)] if rows else []


def mean_of(records: list[dict], key: str) -> float:
    """The mean of one logged figure over step records (nan for none): the heads file's training notes and the
    CLI's summary give the same figure."""
    return sum(r[key] for r in records) / len(records) if records else float("nan")


def plot_loss(log: list[dict], path: Path, title: str, loss_name: str = "SmoothL1 + smoothness") -> None:
    """Loss and top-10 % accuracy per step, with a running mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, name in ((axes[0], "loss", f"loss ({loss_name})"),
                          (axes[1], "top10_accuracy", "top-10 % overlap accuracy")):
        values = [r[key] for r in log]
        ax.plot(steps, values, lw=0.6, alpha=0.4, label="per step")
        window = 25
        if len(values) >= window:
            running = [sum(values[i - window + 1:i + 1]) / window for i in range(window - 1, len(values))]
            ax.plot(steps[window - 1:], running, lw=1.6, label=f"mean of {window}")
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
