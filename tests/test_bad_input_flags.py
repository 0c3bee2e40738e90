"""Bad input to the newer flags and fields, and corrupt caches: one line, exit 2, nothing lost.

Property-based like tests/test_bad_input.py (its strategies and settings): pairs of `--set`
assignments over the precision, context-parallel, Llama and block-scaled fields; the
launch-level lists (`--hardware`, `--gpus`) and a sweep's restriction to them; corrupt
kernel caches and composed-piece caches, which must cost a compile, never a run. A few
subprocess cases check what a user sees: one line on stderr, exit 2, no traceback, and
nothing under the output or checkpoint directory changed.
"""

import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_bad_input import _NUMBERISH, FUZZ, ROOT, _launch, _one_line_naming, _tree

import experiments
from errors import UserInputError
from experiments import overrides
from hardware import catalog
from model import gpt, moe
from modes import options as options_lib
from parallelism import mesh as mesh_lib
from projection import compose, kernel_cache
from sweep import definitions
from train import step as train_step

LLAMA = experiments.load("llama3")
_NEW_KEYS = [
  "precision",
  "context_parallel",
  "tensor_parallel",
  "latency_profile",
  "variant",
  "model.block_scaling",
  "model.attention",
  "model.num_kv_heads",
  "model.rope_theta",
  "model.rope_scale_factor",
  "model.rope_low_freq_factor",
  "model.rope_high_freq_factor",
  "model.rope_original_seq_len",
  "model.positions",
  "model.norm",
  "model.mlp",
  "model.ffn_dim",
  "model.fp8_amax_history",
  "train.loss_jump_factor",
  "train.virtual_stages",
  "mesh.nvlink_domain",
  "mesh.allow_tensor_beyond_nvlink",
]
# Values a user means (each field's choices) beside what a hurried one types.
_VALUES = st.one_of(
  _NUMBERISH,
  st.sampled_from(
    ["bf16", "fp8", "mxfp8", "nvfp4", "cudnn", "xla", "rope", "learned", "rmsnorm", "swiglu"]
  ),
  st.sampled_from(["true", "false", "2", "4", "8", "72", "1.5", "500000.0"]),
)


@FUZZ
@given(
  first=st.tuples(st.sampled_from(_NEW_KEYS), _VALUES),
  second=st.tuples(st.sampled_from(_NEW_KEYS), _VALUES),
)
def test_pairs_of_new_fields_work_or_are_refused_naming_a_field(first, second):
  assignments = [f"{k}={v}" for k, v in (first, second)]
  try:
    exp = overrides.apply(LLAMA, assignments)
    exp.model.validate()
    exp.train.validate()
    mesh_lib.plan(exp.mesh, 8)
  except UserInputError as e:
    names = [k.split(".")[-1] for k, _ in (first, second)]
    _one_line_naming(e, *names, "mesh", "model", "train", "--set", "precision")


MOE = experiments.load("moe")
_MOE_LORA_KEYS = [
  "lora.rank",
  "lora.alpha",
  "lora.dropout",
  "lora.targets",
  "lora.base_dtype",
  "model.num_experts",
  "model.experts_per_token",
  "model.moe_ffn_dim",
  "model.num_shared_experts",
  "model.first_dense_layers",
  "model.router_score",
  "model.router_groups",
  "model.router_topk_groups",
  "model.router_bias_rate",
  "model.aux_loss_coef",
  "model.capacity_factor",
  "model.moe_dispatch",
  "model.kv_lora_rank",
  "model.q_lora_rank",
  "model.rope_head_dim",
  "mesh.expert",
  "mesh.allow_expert_beyond_nvlink",
]
_MOE_VALUES = st.one_of(
  _VALUES,
  st.sampled_from(["sigmoid", "softmax", "capacity", "qkv_kernel,out_kernel", "fc1_kernel", "x"]),
)


@FUZZ
@given(
  base=st.sampled_from([MOE, LLAMA]),
  first=st.tuples(st.sampled_from(_MOE_LORA_KEYS), _MOE_VALUES),
  second=st.tuples(st.sampled_from(_MOE_LORA_KEYS), _MOE_VALUES),
)
def test_moe_and_lora_fields_work_or_are_refused_naming_a_field(base, first, second):
  assignments = [f"{k}={v}" for k, v in (first, second)]
  try:
    exp = overrides.apply(base, assignments)
    exp.model.validate()
    exp.train.validate()
    layout = mesh_lib.plan(exp.mesh, 8)
    exp.lora.validate(gpt.kernels(exp.model), train_step._KNOWN_KERNELS, exp.model.fp8)  # pylint: disable=protected-access
    moe.check_mesh(exp.model, layout.sizes)
  except UserInputError as e:
    names = [k.split(".")[-1] for k, _ in (first, second)]
    _one_line_naming(e, *names, "mesh", "model", "lora", "--set", "expert")


_NAMES = st.one_of(
  st.sampled_from([*catalog.names(), "H100", " h200 ", "host"]), st.text(max_size=6)
)


@FUZZ
@given(
  hardware=st.lists(_NAMES, max_size=3),
  gpus=st.lists(st.one_of(st.integers(-5, 20000).map(str), _NUMBERISH), max_size=3),
)
def test_sweep_restrictions_work_or_are_refused_naming_the_flag(hardware, gpus):
  sweep = experiments.sweep("gpt3")
  options = options_lib.Options(hardware=tuple(hardware), gpus=tuple(gpus))
  try:
    restricted = definitions.restricted(
      sweep, options_lib.hardware_names(options), options_lib.gpu_counts(options)
    )
  except UserInputError as e:
    _one_line_naming(e, "--hardware", "--gpus")
    return
  # Accepted: only the sweep's own generations and counts, each as asked.
  assert set(restricted.hardware) <= set(sweep.hardware)
  assert set(restricted.counts) <= set(sweep.counts)
  if gpus:
    assert set(restricted.counts) == {int(g) for g in gpus}


@FUZZ
@given(content=st.binary(max_size=400))
def test_a_corrupt_kernel_cache_is_read_or_refused_never_raises(tmp_path, content):
  path = tmp_path / "kernels.bin"
  path.write_bytes(content)
  assert kernel_cache._readable(str(path)) in (True, False)  # pylint: disable=protected-access


def test_a_truncated_kernel_cache_is_not_readable(tmp_path):
  # A length-delimited field (tag 0x0a) announcing 100 bytes, then only 3: a save cut short.
  path = tmp_path / "kernels.bin"
  path.write_bytes(b"\x0a\x64abc")
  assert not kernel_cache._readable(str(path))  # pylint: disable=protected-access
  path.write_bytes(b"\x0a\x03abc")
  assert kernel_cache._readable(str(path))  # pylint: disable=protected-access


_PIECE = compose.Piece(1, 2, None, 3, 4, "cuda", None, 5.0)


@FUZZ
@given(
  content=st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
      [
        pickle.dumps([_PIECE])[:-5],  # truncated by a kill
        pickle.dumps({"not": "pieces"}),
        pickle.dumps([]),
        pickle.dumps([_PIECE, "x"]),
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x03os.\x94",  # a foreign global
      ]
    ),
  )
)
def test_a_corrupt_piece_cache_is_compiled_anew_never_raises(tmp_path, content):
  path = tmp_path / "pieces.pkl"
  path.write_bytes(content)
  assert compose.cached_pieces(str(path)) is None


def test_a_whole_piece_cache_is_read(tmp_path):
  path = tmp_path / "pieces.pkl"
  path.write_bytes(pickle.dumps([_PIECE]))
  assert compose.cached_pieces(str(path)) == [_PIECE]


def test_a_projection_with_a_corrupt_kernel_cache_compiles_without_it(tmp_path):
  cache = tmp_path / "kernels.bin"
  # A length-delimited field of 64 bytes cut after 10, as a kill mid-write leaves it (random
  # bytes parse as well-formed wire format about 1 time in 800: not a fixture).
  cache.write_bytes(b"\x0a\x40" + b"x" * 10)
  assert not kernel_cache._readable(str(cache))  # pylint: disable=protected-access
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env[kernel_cache.KERNEL_CACHE_ENV] = str(cache)
  done = subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=project", "--hardware=h100"]
    + ["--gpus=8", f"--output_dir={tmp_path / 'out'}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "is not a kernel cache XLA can read" in done.stderr
  assert kernel_cache._readable(str(cache))  # pylint: disable=protected-access (replaced)


@pytest.mark.parametrize(
  "args, message",
  [
    (["--mode=sweep", "--experiment=gpt3", "--gpus="], "--gpus: empty"),
    (["--mode=sweep", "--experiment=gpt3", "--hardware="], "--hardware: empty"),
    (["--mode=sweep", "--experiment=gpt3", "--gpus=7"], "--gpus: 7 is not one of this sweep"),
    (["--resume_from=3"], "--resume_from needs --checkpoint_dir"),
    (["--set", "train.loss_jump_factor=0.5"], "train.loss_jump_factor must be 0"),
  ],
)
def test_bad_new_flags_are_one_line_exit_2_and_change_nothing(tmp_path, args, message):
  out, ckpt = tmp_path / "out", tmp_path / "ckpt"
  out.mkdir()
  (out / "results.jsonl").write_text('{"kept": 1}\n')
  ckpt.mkdir()
  before = _tree(tmp_path)
  done = _launch(f"--output_dir={out}", *args, cwd=str(tmp_path))
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
  assert message in lines[0] and "Traceback" not in done.stderr
  assert _tree(tmp_path) == before


def test_resume_from_a_missing_step_is_refused_and_moves_nothing(tmp_path):
  out, ckpt = tmp_path / "out", tmp_path / "ckpt"
  done = _launch(
    f"--output_dir={out}", f"--checkpoint_dir={ckpt}", "--steps=1", "--checkpoint_every=1"
  )
  assert done.returncode == 0, done.stderr[-3000:]
  before = _tree(tmp_path)
  done = _launch(f"--output_dir={out}", f"--checkpoint_dir={ckpt}", "--resume_from=99")
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
  assert "--resume_from: no checkpoint of step 99" in lines[0]
  assert _tree(tmp_path) == before
