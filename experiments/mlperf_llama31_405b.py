"""The MLPerf Training Llama 3.1 405B benchmark (rounds v5.0, v5.1, v6.0): train Llama 3.1 405B
from Meta's checkpoint to a validation log perplexity of 5.6; the score is the wall clock
(evaluation included), RCP-normalized.

The published definition, reference convergence and calibration points are in
reference/mlperf_llama31_405b.py (sources: docs/sources/mlperf-llama31-405b.md). The
recorded `time_to_train_min` is the RCP-normalized score, comparable with the published
one; `time_to_train.run_time_min` is the run's own wall clock, comparable with its result
log (experiments/_time_to_train.py RcpNormalizedTimeToTrain, the RCP chosen as MLPerf's
checker chooses it: experiments/_rcp.py). The published configurations are named
variants; a projection on a target that matches one uses it, and any other target its
generation's published layout (`for_target`). Every round scores against its own RCPs
and evaluation schedule (`ROUNDS`), v5.0 (the calibration runs') unless `--set round=`:

  python launch.py --mode=project --experiment=mlperf_llama31_405b --hardware=h100 --gpus=8192
  python launch.py --mode=project --experiment=mlperf_llama31_405b --hardware=gb200 --gpus=2496
  python launch.py --mode=project --experiment=mlperf_llama31_405b --hardware=h100 \
    --gpus=512 --set round=v6.0 --set global_batch=448
"""

import dataclasses
import math

import experiments
from experiments import ExperimentConfig
from experiments._rcp import checker_means
from experiments._time_to_train import RcpNormalizedTimeToTrain
from model.presets import preset
from parallelism.mesh import MeshConfig
from reference import mlperf_llama31_405b as published
from train.config import TrainConfig


def benchmark(round_name: str) -> RcpNormalizedTimeToTrain:
  """The benchmark as a round defines it: its evaluation schedule and its RCPs."""
  return RcpNormalizedTimeToTrain(
    name=f"mlperf_llama31_405b {round_name}",
    seq_len=published.SEQ_LEN,
    eval_interval_sequences=published.EVAL_INTERVAL_SEQUENCES[round_name],
    eval_sequences=published.EVAL_SEQUENCES,
    mean_samples_by_global_batch=checker_means(published.RCP_SAMPLES[round_name]),
    eval_skip_base=published.EVAL_SKIP_BASE[round_name],
    eval_skip_per_10k_sequences=published.EVAL_SKIP_PER_10K_SEQUENCES[round_name],
  )


# The benchmark by round, chosen with `--set round=NAME` (experiments.mlperf_round).
ROUNDS = {name: benchmark(name) for name in published.EVAL_INTERVAL_SEQUENCES}


def train_config(global_batch: int, micro_batch: int, round_name: str = "v5.0") -> TrainConfig:
  """The benchmark's optimizer and schedule for a global batch (its rules): AdamW 0.9 /
  0.95, eps 1e-5, weight decay 0.1, clip 1.0; peak 8e-5 x GBS / 1152 after ceil(8000 x
  1152 / GBS) warm-up steps, cosine decay to 8e-7."""
  peak = published.learning_rate(global_batch)
  return TrainConfig(
    global_batch=global_batch,
    micro_batch=micro_batch,
    steps=ROUNDS[round_name].steps_to_converge(global_batch),
    learning_rate=peak,
    lr_warmup_steps=published.warmup_steps(global_batch),
    lr_decay_steps=published.decay_steps(global_batch),
    min_lr_ratio=published.END_LEARNING_RATE / peak,
    weight_decay=published.WEIGHT_DECAY,
    beta1=published.BETA1,
    beta2=published.BETA2,
    eps=published.EPS,
    grad_clip=published.GRAD_CLIP,
  )


# Llama 3.1 405B with the benchmark's tokenizer (the Mixtral 8x22B vocabulary), sequence
# 8,192. As for GPT-3 175B (experiments/mlperf_gpt3_175b.py, which gives the reasons):
# bf16 parameters and Adam moments split over `data` (the published runs keep fp32
# master weights in Megatron's distributed optimizer), cuDNN flash attention, sequence
# parallelism, the saved activations of Megatron's runs without recomputation (remat
# "elementwise"), FP8 with delayed scaling by Transformer Engine's defaults.
MODEL = dataclasses.replace(
  preset("llama3.1-405b"),
  vocab_size=published.VOCAB_SIZE,
  param_dtype="bfloat16",
  remat="elementwise",
  attention="cudnn",
  sequence_parallel=True,
  fp8=True,
  fp8_amax_history=1024,
)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a run is laid out and batched (the published runs' fields of the same names)."""

  hardware: str
  gpus: int
  tensor: int
  global_batch: int
  round_name: str = "v5.0"
  pipeline: int = published.PIPELINE
  virtual_stages: int = published.VIRTUAL_STAGES
  context: int = published.CONTEXT
  micro_batch: int = published.MICRO_BATCH


def _experiment(run: Layout, description: str) -> ExperimentConfig:
  """A layout: data parallelism over the GPUs that TP x PP x CP leave."""
  return ExperimentConfig(
    name="mlperf_llama31_405b",
    description=description,
    model=MODEL,
    mesh=MeshConfig(data=-1, context=run.context, tensor=run.tensor, pipeline=run.pipeline),
    # The published runs' interleaved 1F1B schedule (parallelism/one_f_one_b.py); 126
    # layers in 8 x 8 chunks of 2 slots, the embedding and the loss counted as layers
    # (parallelism/pipeline.py split).
    train=dataclasses.replace(
      train_config(run.global_batch, run.micro_batch, run.round_name),
      pipeline_schedule="1f1b",
      virtual_stages=run.virtual_stages,
      shard_optimizer=True,
    ),
    benchmark=ROUNDS[run.round_name],
    latency_profile=True,
  )


def _published(run: published.PublishedRun) -> ExperimentConfig:
  layout = Layout(
    run.hardware,
    run.gpus,
    run.tensor,
    run.global_batch,
    run.round_name,
    run.pipeline,
    run.virtual_stages,
    run.context,
    run.micro_batch,
  )
  return _experiment(
    layout,
    f"{run.round_name} {run.system}: {run.gpus:,} {run.hardware.upper()}, "
    f"TP {run.tensor}, PP {run.pipeline}, virtual stages {run.virtual_stages}, CP "
    f"{run.context}, micro-batch {run.micro_batch}, GBS {run.global_batch} "
    f"(published {run.score_min} min)",
  )


# The calibration points (reference/mlperf_llama31_405b.py CALIBRATION), by name. No
# efficiency parameter of hardware/catalog.py is fitted to them.
PUBLISHED = {
  "eos_8192": published.CALIBRATION[0],
  "carina_2496": published.CALIBRATION[1],
}


def global_batch(replicas: int, pipeline: int = published.PIPELINE) -> int:
  """The smallest multiple of replicas x pipeline at or above the rules' base batch of
  1,152: every replica gets a whole number of micro-batches, a multiple of the pipeline
  depth as the interleaved schedule needs. Both calibration runs follow it: 64 replicas
  x 8 -> 1,536 (Eos), 39 x 8 -> 1,248 (Carina)."""
  step = replicas * pipeline
  return step * math.ceil(published.BASE_GLOBAL_BATCH / step)


def layout(hardware: str, gpus: int) -> Layout | None:
  """The published layout of `hardware`'s generation on `gpus` GPUs (None for a
  generation MLPerf has no Llama run on, or a count TP x PP x CP does not divide)."""
  tensor = published.TENSOR_BY_HARDWARE.get(hardware)
  if tensor is None:
    return None
  per_replica = tensor * published.PIPELINE * published.CONTEXT
  if gpus % per_replica:
    return None
  return Layout(hardware, gpus, tensor, global_batch(gpus // per_replica))


def for_target(exp: ExperimentConfig, hardware: str, gpus: int) -> ExperimentConfig:
  """What `gpus` GPUs of `hardware` run by default: the published run where one matches,
  else the generation's published layout (`layout`), else `exp`."""
  for name, run in PUBLISHED.items():
    if (run.hardware, run.gpus) == (hardware, gpus):
      return experiments.variant(exp, name)
  chosen = layout(hardware, gpus)
  if chosen is None:
    return exp
  return dataclasses.replace(
    _experiment(
      chosen,
      f"{gpus:,} {hardware.upper()} in the generation's published layout: TP "
      f"{chosen.tensor}, PP {chosen.pipeline}, virtual stages {chosen.virtual_stages}, CP "
      f"{chosen.context}, micro-batch {chosen.micro_batch}, GBS {chosen.global_batch}",
    ),
    variants=exp.variants,
  )


def get_config() -> ExperimentConfig:
  variants = {name: _published(run) for name, run in PUBLISHED.items()}
  return dataclasses.replace(
    variants["eos_8192"],
    variants=variants,
    description="MLPerf Llama 3.1 405B time to train (RCP-normalized); on a target, the "
    "published run where one matches (eos_8192 H100, carina_2496 GB200), else the "
    "generation's published layout (TP 8 H100, 4 H200 / B200 / GB200, 2 GB300; PP 8, VP 8, "
    "CP 2, micro-batch 1) with the batch of `global_batch`",
  )
