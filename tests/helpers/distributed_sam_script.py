"""Runs FlatBiasTrainer SAM/ASAM cases inside one launched process group and saves each rank's final weights.

Started by `tests/distributed/test_distributed.py` through ``accelerate launch`` (1 or 2 CPU processes); launching
is the slow part (imports, DeepSpeed start-up), so one launch runs every case in turn and the tests only read the
files:

    accelerate launch --config_file recipes/configs/accelerate_cpu_2proc.yaml \
        tests/helpers/distributed_sam_script.py CASES.json OUT_DIR

CASES.json is a list of cases (see `Case`); for each case the script writes ``OUT_DIR/<name>.rank<r>.pt`` (the
trained parameters, gathered under ZeRO-3) or ``OUT_DIR/<name>.rank<r>.error`` (the message of a ValueError the
trainer raised), and ``OUT_DIR/<name>.rank<r>.json`` (SAM metrics, timing).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from tests.helpers import tiny_models  # noqa: E402
from tests.helpers.tiny_models import SEQ_LEN, VOCAB, tiny_classifier, word_tokenizer  # noqa: E402
from tests.helpers.trl_heads import head_paths_counted  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "recipes" / "configs"

N_ROWS = 48


@dataclass
class Case:
    """One training run; ``args`` override the FlatBiasConfig defaults.

    ``engine``: "ddp", "zero0".."zero3" (the DeepSpeed JSON in recipes/configs passed as ``deepspeed=``), or
    "launcher" (whatever the ``accelerate launch`` config set up, e.g. FSDP2). A "ddp" case inside an FSDP launch
    drops the launcher's FSDP settings.
    """

    name: str
    engine: str
    args: dict = field(default_factory=dict)
    deepspeed_overrides: dict = field(default_factory=dict)
    #: Train to ``max_steps`` saving at ``resume_from_step``, then train again resuming from that checkpoint.
    resume_from_step: int | None = None
    #: "sam": train and save the weights; "trace": set up the engine on a masked LM, then every rank calls
    #: estimate_hessian_trace(across_processes=True) with ``trace`` as keyword arguments; "trace_callback": a
    #: HessianTraceCallback(**trace) measures during a step at learning rate 0 (``also_measure`` too); "sft":
    #: FlatBiasSFTTrainer trains `sft_trainer` (``task`` unused) and saves the weights; "dpo": FlatBiasDPOTrainer
    #: trains `dpo_trainer` likewise.
    kind: str = "sam"
    trace: dict = field(default_factory=dict)
    #: What a "sam" case trains: "classification" (`tiny_classifier` on `classification_rows`) or "masked_lm"
    #: (`tiny_mlm` on `token_weighted_rows`, whose micro-batches and ranks hold unequal label counts). What a trace
    #: case measures: "masked_lm" (`tiny_masked_lm` on `masked_rows`) or "causal_lm" (`tiny_causal_lm` on
    #: `causal_rows`; FSDP2 through accelerate 1.15 cannot shard BERT's masked-LM head, whose bias is tied). A "sam"
    #: case on "causal_lm" trains `tiny_causal_lm` on `causal_training_rows`.
    task: str = "classification"
    #: LoRA adapters (``peft.LoraConfig`` keyword arguments) on the model before training, or ``None``.
    lora: dict | None = None


def classification_rows(n: int = N_ROWS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    return tiny_models.classification_rows(n, seed)


def token_weighted_rows(n: int = N_ROWS) -> list[dict[str, torch.Tensor]]:
    """Randomly masked rows (15%) for the token-weighted loss across processes."""
    return tiny_models.randomly_masked_rows(n)


def tiny_masked_lm(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return BertForMaskedLM(config)


def tiny_causal_lm(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return tiny_models.randomize_norms(LlamaForCausalLM(LlamaConfig(**tiny_models.TINY_DECODER)))


def causal_rows(n: int = 7, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """One labelled position per row (never the first, which a causal LM cannot predict): one context each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, tiny_models.TINY_DECODER["vocab_size"], (n, SEQ_LEN), generator=g)
    rows = []
    for i in range(n):
        labels = torch.full((SEQ_LEN,), -100)
        position = 1 + i % (SEQ_LEN - 1)
        labels[position] = ids[i, position]
        rows.append({"input_ids": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": labels})
    return rows


#: What a trace case measures, by its ``task``: the model builder and its rows.
TRACE_TASKS = {
    "masked_lm": ("tiny_masked_lm", "masked_rows"),
    "causal_lm": ("tiny_causal_lm", "causal_rows"),
    "causal_lm_float64": ("tiny_causal_lm_float64", "causal_rows"),
}


def trace_task(task: str):
    model_name, rows_name = TRACE_TASKS.get(task, TRACE_TASKS["masked_lm"])
    return globals()[model_name], globals()[rows_name]


def masked_rows(n: int = 7, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """One masked position per row (token 4 stands for [MASK]): each row is one trace context."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, SEQ_LEN), generator=g)
    rows = []
    for i in range(n):
        position = i % SEQ_LEN
        labels = torch.full((SEQ_LEN,), -100)
        labels[position] = ids[i, position]
        input_ids = ids[i].clone()
        input_ids[position] = 4
        rows.append({"input_ids": input_ids, "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": labels})
    return rows


def base_arguments(output_dir: str) -> dict:
    return tiny_models.trainer_arguments(
        output_dir, per_device_train_batch_size=2, flatness_method="sam", sam_rho=0.05, disable_tqdm=True
    )


def deepspeed_config(stage: int, overrides: dict) -> dict:
    config = json.loads((CONFIGS / f"deepspeed_zero{stage}.json").read_text())
    for dotted, value in overrides.items():
        node = config
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return config


def work_around_accelerate_cpu_world_size() -> None:
    """Test harness only: accelerate 1.15 miscounts the processes of DeepSpeed and FSDP launches on CPU.

    Without a GPU, accelerate picks no backend for either. DeepSpeed then sets up all processes while accelerate
    counts one, so DeepSpeed rejects ``train_batch_size`` (``8 != 8 * 1 * 2``): answer gloo as a multi-CPU run does.
    With FSDP each process silently trains alone (world size 1, no sharding), and ``use_cpu=True`` runs DDP over
    gloo, dropping the FSDP settings (accelerate turns FSDP on only for its GPU-like distributed types): answer gloo
    as for GPUs with the device pinned to the CPU, and accelerate shards with FSDP over gloo.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_hf_flatbias_patched", False):
        return

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if chosen is not None or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return chosen, distributed_type
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            return "gloo", DistributedType.MULTI_CPU
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not cpu:
            self.device = torch.device("cpu")  # set_device keeps a device already set
            return "gloo", DistributedType.MULTI_GPU
        return chosen, distributed_type

    prepare_backend._hf_flatbias_patched = True
    PartialState._prepare_backend = prepare_backend


def reset_accelerate(launch_environment: dict[str, str], *, keep_fsdp: bool = True) -> None:
    """Forget the previous case: accelerate keeps its state in class attributes and flags in the environment.

    ``keep_fsdp=False`` drops an FSDP launcher's settings, so that a DDP case runs inside an FSDP launch."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        del os.environ[key]
    os.environ.update(
        {
            k: v
            for k, v in launch_environment.items()
            if k.startswith("ACCELERATE_") and (keep_fsdp or k != "ACCELERATE_USE_FSDP")
        }
    )
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
    unset_hf_deepspeed_config()


def trained_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    if any(isinstance(p, DTensor) for p in params.values()):  # FSDP2: gather each parameter from its shards
        return {name: p.full_tensor().detach().clone() for name, p in params.items()}
    if any(hasattr(p, "ds_tensor") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().clone() for name, p in params.items()}
    return {name: p.detach().clone() for name, p in params.items()}


def run_trace_case(case: Case, values: dict) -> dict:
    """The engine is set up by one training step at learning rate 0, so the weights stay those of `tiny_masked_lm`."""
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
    from hf_flatbias.flatness import api
    from hf_flatbias.sharpness.engines import deepspeed_zero_stage

    values.update(flatness_method="none", learning_rate=0.0, max_steps=1)
    model, rows = trace_task(case.task)
    trainer = FlatBiasTrainer(model=with_lora(model(), case.lora), args=FlatBiasConfig(**values), train_dataset=rows())
    trainer.train()
    summarized = []
    real_summary = api.summarize_trace_samples

    def keep_samples(samples, **kwargs):
        summarized.append(samples)
        return real_summary(samples, **kwargs)

    api.summarize_trace_samples = keep_samples
    try:
        estimate = api.estimate_hessian_trace(trainer.model, rows(), across_processes=True, **case.trace)
    finally:
        api.summarize_trace_samples = real_summary
    return {
        "estimate": estimate.to_dict(),
        "per_context_values": summarized[0].values,
        "world_size": trainer.args.world_size,
        "zero_stage": deepspeed_zero_stage(trainer.deepspeed_engine()),
    }


def run_trace_callback_case(case: Case, values: dict) -> dict:
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
    from hf_flatbias.callbacks import TRACE_METRIC, HessianTraceCallback
    from hf_flatbias.sharpness.engines import deepspeed_zero_stage

    values.update(flatness_method="none", learning_rate=0.0, max_steps=1)
    model, rows = trace_task(case.task)
    callback = HessianTraceCallback(rows(), every_n_steps=1, on_evaluate=False, mask_token_id=4, **case.trace)
    trainer = FlatBiasTrainer(
        model=with_lora(model(), case.lora), args=FlatBiasConfig(**values), train_dataset=rows(), callbacks=[callback]
    )
    trainer.train()
    logged = [entry[TRACE_METRIC] for entry in trainer.state.log_history if TRACE_METRIC in entry]
    return {
        "logged_trace": logged,
        "contexts": callback._contexts,
        "world_size": trainer.args.world_size,
        "estimate": callback.last_estimate.to_dict(),
        "measures": {name: result.to_dict() for name, result in callback.flatness_record.measures.items()},
        "zero_stage": deepspeed_zero_stage(trainer.deepspeed_engine()),
    }


def with_lora(model: torch.nn.Module, lora: dict | None) -> torch.nn.Module:
    if lora is None:
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(**lora))


def record_perturbation_bytes() -> list[tuple[str, int]]:
    """The layout (class) and bytes each perturbation of this process holds (the saved ``w``: the step's extra
    parameter copy)."""
    from hf_flatbias.sharpness.engines import PerturbableParameters
    from hf_flatbias.sharpness.fsdp_per_rank import PerRankFullyShardedParameters

    held: list[tuple[str, int]] = []
    for layout in (PerturbableParameters, PerRankFullyShardedParameters):
        own = layout.__dict__["perturb"]
        original = getattr(own, "_hf_flatbias_original", own)

        def perturb(self, *args, _original=original, **kwargs):
            perturbation = _original(self, *args, **kwargs)
            if perturbation is not None:
                saved = sum(t.numel() * t.element_size() for t in perturbation.saved_weights)
                held.append((type(self).__name__, saved))
            return perturbation

        perturb._hf_flatbias_original = original
        layout.perturb = perturb
    return held


def tiny_causal_lm_float64(seed: int = 0) -> torch.nn.Module:
    """`tiny_causal_lm` in float64: its wide initialisation makes SAM amplify float32 rounding to ~1e-6 between
    reduction orders (DDP's all-reduce, FSDP2's reduce-scatter, one process's sum); in float64 that noise is ~1e-15,
    so the layouts can be held to each other tightly."""
    return tiny_causal_lm(seed).double()


def causal_training_rows(n: int = N_ROWS) -> list[dict[str, torch.Tensor]]:
    """`causal_rows` enough for training: one label per row, so ranks and micro-batches hold equal counts."""
    return causal_rows(n)


#: What a "sam" case trains, by its ``task``: the model builder and its rows.
TRAINING_TASKS = {
    "classification": (tiny_classifier, classification_rows),
    "masked_lm": (tiny_models.tiny_mlm, token_weighted_rows),
    "causal_lm": (tiny_causal_lm, causal_training_rows),
    "causal_lm_float64": (tiny_causal_lm_float64, causal_training_rows),
    "classification_float64": (lambda: tiny_classifier().double(), classification_rows),
}


def sft_trainer(values: dict):
    """`tests.test_trl.sft_trainer`'s completion-only SFT of a fresh `tiny_llama`, in float64, with ``values`` as
    its config fields (trl's bf16 default off, rows in order); the head's gradients are formed in the forward where
    output-layer SAM replays the trunk."""
    from tests.test_trl import N_WORDS
    from tests.test_trl import sft_trainer as trl_sft_trainer

    values = dict(values)
    output_dir = values.pop("output_dir")
    return trl_sft_trainer(output_dir, word_tokenizer(N_WORDS), "completion_only", dtype=torch.float64, **values)


def dpo_trainer(values: dict):
    """`tests.test_trl.dpo_trainer`'s DPO (beta 0.5, a live reference model) of a fresh `tiny_llama`, in float64 (that
    builder's float32 would hide a cross-rank difference under rounding), on 16 of its preference pairs (its 12 are
    too few for 2 updates of 8 pairs), with ``values`` as its config fields."""
    import copy

    from hf_flatbias import FlatBiasDPOTrainer
    from tests.test_trl import N_WORDS, dpo_config, preference_rows

    values = dict(values)
    tokenizer = word_tokenizer(N_WORDS)
    model = tiny_models.tiny_llama(len(tokenizer)).double()
    return FlatBiasDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=dpo_config(values.pop("output_dir"), precompute_ref_log_probs=False, **values),
        train_dataset=preference_rows(n=16),
        processing_class=tokenizer,
    )


@contextlib.contextmanager
def fused_head_in_model_dtype() -> Iterator[None]:
    """trl's fused LM head (DPO's log-probabilities; SFT's where its own head path falls back to trl's, as under
    ZeRO-3) computed from the full logits in the model's dtype inside the block. trl's kernel accumulates in float32
    whatever the dtype, and its rounding depends on how many rows a process holds: 2 processes of 2 rows then differ
    from 1 process of 4 by ~1e-8 in float64 (measured), which would hide a cross-rank fault of that size; in float64
    throughout they agree to ~1e-16."""
    import trl.trainer.utils as trl_utils

    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        if softcap is not None or logit_scale != 1.0:
            raise NotImplementedError("the tests' Llama has no logit softcap or scale")
        logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
        log_p = torch.log_softmax(logits, -1)
        picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        log_sum_sq = torch.logsumexp(2 * log_p, -1).detach() if "log_sum_sq_probs" in outputs else None
        mean_logits = logits.mean(-1).detach() if "mean_logits" in outputs else None
        is_top1 = (
            (logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) >= logits.amax(-1)) if "is_top1" in outputs else None
        )
        return picked, entropy, log_sum_sq, mean_logits, is_top1

    kernel = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = type("ModelDtypeHead", (), {"apply": staticmethod(apply)})
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = kernel


def run_trl_case(values: dict, build) -> dict:
    with fused_head_in_model_dtype(), head_paths_counted() as counts:
        trainer = build(values)
        first_layer_forwards: list[int] = []
        trainer.model.model.layers[0].register_forward_pre_hook(lambda module, args: first_layer_forwards.append(1))
        trainer.train()
    return {
        "params": trained_parameters(trainer.model),
        "world_size": trainer.args.world_size,
        "first_layer_forwards": len(first_layer_forwards),
        "log_history": trainer.state.log_history,
        **counts,
    }


def run_case(case: Case, out_dir: Path, rank: int) -> dict:
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
    from hf_flatbias.sharpness.engines import deepspeed_zero_stage

    work = out_dir / "work" / case.name
    values = base_arguments(str(work))
    values.update(case.args)
    if case.engine == "ddp":
        values["use_cpu"] = True
    elif case.engine == "launcher":
        pass  # the engine comes from the `accelerate launch` config (ACCELERATE_* variables)
    else:
        values["deepspeed"] = deepspeed_config(int(case.engine.removeprefix("zero")), case.deepspeed_overrides)
    if case.resume_from_step is not None:
        values.update(save_strategy="steps", save_steps=case.resume_from_step)
    # accelerate 1.15 cannot shard a BERT by its own _no_split_modules (BertEmbeddings holds the word embedding it
    # carves out again): its layers are named, as a user sets fsdp_transformer_layer_cls_to_wrap
    if case.kind == "sam" and not case.task.startswith("causal_lm"):
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = "BertLayer"
    else:
        os.environ.pop("FSDP_TRANSFORMER_CLS_TO_WRAP", None)
    if case.kind == "trace":
        return run_trace_case(case, values)
    if case.kind == "trace_callback":
        return run_trace_callback_case(case, values)
    if case.kind in ("sft", "dpo"):
        return run_trl_case(values, sft_trainer if case.kind == "sft" else dpo_trainer)

    model, rows = TRAINING_TASKS[case.task]
    first_layer_forwards: list[int] = []

    def train(resume_from_checkpoint: str | None = None) -> FlatBiasTrainer:
        args = FlatBiasConfig(**values)
        trainer = FlatBiasTrainer(model=with_lora(model(), case.lora), args=args, train_dataset=rows())
        layers = getattr(getattr(trainer.model, "model", None), "layers", None)
        if layers is not None:  # a decoder's trunk: how often it ran forward (output-layer SAM replays it)
            layers[0].register_forward_pre_hook(lambda module, args: first_layer_forwards.append(1))
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        return trainer

    held_bytes = record_perturbation_bytes()
    trainer = train()
    result = {"params": trained_parameters(trainer.model)}
    result["perturbation_bytes"] = max((size for _, size in held_bytes), default=0)
    result["perturbation_layouts"] = sorted({layout for layout, _ in held_bytes})
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    result["trainable_bytes"] = sum(p.numel() * p.element_size() for n, p in result["params"].items() if n in trainable)
    if case.resume_from_step is not None:
        checkpoint = work / f"checkpoint-{case.resume_from_step}"
        trainer.accelerator.wait_for_everyone()
        resumed = train(resume_from_checkpoint=str(checkpoint))
        result["resumed_params"] = trained_parameters(resumed.model)
        trainer = resumed
    result["log_history"] = trainer.state.log_history
    result["token_weighted_loss"] = trainer._token_weighted_loss
    result["world_size"] = trainer.args.world_size
    result["first_layer_forwards"] = len(first_layer_forwards)
    result["zero_stage"] = deepspeed_zero_stage(trainer.deepspeed_engine())
    return result


def main(cases_file: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [Case(**c) for c in json.loads(Path(cases_file).read_text())]
    launch_environment = dict(os.environ)
    work_around_accelerate_cpu_world_size()
    rank = int(os.environ.get("RANK", "0"))
    for case in cases:
        reset_accelerate(launch_environment, keep_fsdp=case.engine != "ddp")
        start = time.perf_counter()
        stem = f"{case.name}.rank{rank}"
        try:
            result = run_case(case, out_dir, rank)
        except ValueError as error:
            (out_dir / f"{stem}.error").write_text(str(error))
            continue
        tensors = {key: result.pop(key) for key in ("params", "resumed_params", "per_context_values") if key in result}
        torch.save(tensors, out_dir / f"{stem}.pt")
        result.update(case=asdict(case), seconds=time.perf_counter() - start)
        (out_dir / f"{stem}.json").write_text(json.dumps(result, default=str))
        print(f"[rank {rank}] {case.name}: {result['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    if "RANK" not in os.environ:
        # A plain one-process start (`python script` or accelerate with one process): DeepSpeed still needs the
        # variables a launcher would set, or it tries MPI.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    main(sys.argv[1], sys.argv[2])
