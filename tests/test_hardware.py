"""Hardware catalog (published figures) and host profile (measured here)."""

import dataclasses
import json

import pytest

from hardware.catalog import Hardware, get, missing_sources, names

GPUS = ["a100", "h100", "h200", "b200", "gb200", "gb300"]


def test_catalog_lists_the_six_gpus():
  assert names() == GPUS


@pytest.mark.parametrize("name", GPUS)
def test_every_figure_has_a_source(name):
  hw = get(name)
  assert missing_sources(hw) == []
  assert all(isinstance(v, str) and len(v) > 10 for v in hw.sources.values())


@pytest.mark.parametrize("name", GPUS)
def test_figures_are_sane(name):
  hw = get(name)
  assert hw.achievable_bf16_tflops < hw.peak_bf16_tflops
  if hw.peak_fp8_tflops is not None:
    # 989.4 rounds to 989 but 1,978.9 to 1,979
    assert hw.peak_fp8_tflops == pytest.approx(2 * hw.peak_bf16_tflops, rel=1e-3)
    assert hw.achievable_bf16_tflops < hw.achievable_fp8_tflops < hw.peak_fp8_tflops
  assert 0.5 < hw.hbm_achievable_fraction <= 1.0
  assert hw.hbm_achievable_tb_s < hw.hbm_peak_tb_s
  # Achievable bandwidths sit below the line rates they come from.
  assert hw.allreduce_ring_busbw_gb_s < hw.nvlink_gb_s
  assert hw.nic_achievable_gb_s < hw.nic_gbit_s / 8
  assert hw.nvlink_sharp == (hw.allreduce_nvls_busbw_gb_s is not None)
  assert hw.nvlink_domain_size % hw.gpus_per_node == 0
  assert 1 <= hw.kernel_launch_us <= 10
  simple = hw.protocols[0]
  assert simple.name == "simple" and simple.bandwidth_fraction == 1.0
  assert simple.base_us == pytest.approx(8.4) and simple.net_hop_us == pytest.approx(14.0)


def test_generations_are_ordered():
  bf16 = {n: get(n).peak_bf16_tflops for n in GPUS}
  assert bf16["b200"] > bf16["h100"] > bf16["a100"]
  assert get("b200").achievable_bf16_tflops > get("h100").achievable_bf16_tflops
  assert get("h200").hbm_gib > get("h100").hbm_gib
  assert get("h200").hbm_peak_tb_s > get("h100").hbm_peak_tb_s
  assert get("gb300").hbm_gib > get("gb200").hbm_gib > get("b200").hbm_gib
  assert get("gb200").nvlink_domain_size == get("gb300").nvlink_domain_size == 72
  assert all(get(n).nvlink_domain_size == 8 for n in ["a100", "h100", "h200", "b200"])
  assert get("gb300").nic_gb_s_per_gpu > get("gb200").nic_gb_s_per_gpu
  assert not get("a100").nvlink_sharp and all(get(n).nvlink_sharp for n in GPUS[1:])
  assert get("a100").peak_fp8_tflops is None and get("a100").achievable_tflops("fp8") is None


def test_dtype_lookup():
  h100 = get("h100")
  assert h100.peak_tflops("bfloat16") == 989.0
  assert h100.achievable_tflops("fp8") == 1403.0
  with pytest.raises(ValueError, match="known"):
    h100.peak_tflops("int4")


def test_usable_memory_matches_the_h100_target_file():
  # device_memory_size of XLA's H100 SXM 80GB device description (docs/sources/hardware.md)
  assert get("h100").hbm_bytes == pytest.approx(84942979072, rel=1e-9)


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError) as err:
    get("tpu-v5p")
  for name in GPUS:
    assert name in str(err.value)
  assert get(" H100 ") is get("h100")


def test_entries_are_frozen_data():
  hw = get("h100")
  with pytest.raises(dataclasses.FrozenInstanceError):
    hw.peak_bf16_tflops = 1.0
  # A new GPU is a new entry, no code: derive one and it works everywhere.
  h100_nvl = dataclasses.replace(hw, name="h100-2nic", nics_per_gpu=2)
  assert h100_nvl.nic_gb_s_per_gpu == 2 * hw.nic_gb_s_per_gpu
  assert hash(hw)  # usable as a dict key despite the sources mapping


# ---------------------------------------------------------------------------
# Host profile
# ---------------------------------------------------------------------------


def test_host_profile_measures_caches_and_reloads(tmp_path, monkeypatch):
  from measure import host, host_calibration

  path = tmp_path / "host_profile.json"
  hw = host_calibration.host_profile(cache_path=path, quick=True)
  assert isinstance(hw, Hardware) and hw.name == "host"
  assert hw.gpus_per_node == hw.nvlink_domain_size == 1  # one active device by default
  for value in (
    hw.peak_bf16_tflops,
    hw.achievable_f32_tflops,
    hw.hbm_peak_tb_s,
    hw.allreduce_ring_busbw_gb_s,
    hw.allgather_ring_busbw_gb_s,
    hw.hbm_gib,
  ):
    assert value > 0
  assert hw.achievable_bf16_tflops <= hw.peak_bf16_tflops
  assert hw.protocols[0].base_us > 0 and hw.kernel_launch_us > 0
  assert missing_sources(hw) == []

  data = json.loads(path.read_text())
  (entry,) = data["profiles"].values()
  assert entry["identity"] == host.machine_identity()
  assert entry["quick"] is True

  # Second call: from the file, no measurement (a measurement would raise).
  def no_measure(quick, devices):
    raise AssertionError("re-measured despite the cache")

  monkeypatch.setattr(host_calibration, "_measure", no_measure)
  again = host_calibration.host_profile(cache_path=path, quick=True)
  assert again == hw
  # A full profile is not satisfied by a cached quick one; refresh forces a run.
  with pytest.raises(AssertionError, match="re-measured"):
    host_calibration.host_profile(cache_path=path, quick=False)
  with pytest.raises(AssertionError, match="re-measured"):
    host_calibration.host_profile(cache_path=path, quick=True, refresh=True)


def test_host_profile_feeds_the_cost_model(tmp_path):
  from measure import host_calibration
  from projection.collectives import collective_time_s

  hw = host_calibration.host_profile(devices=2, cache_path=tmp_path / "p.json", quick=True)
  n = hw.nvlink_domain_size  # the active devices
  small = collective_time_s("all-reduce", 4096, [0] * n, hw)
  big = collective_time_s("all-reduce", 64 << 20, [0] * n, hw)
  assert 0 < small < big
  if n > 1:  # the latency term is the fitted alpha
    assert small >= hw.protocols[0].base_us * 1e-6


def test_projection_hardware_host_uses_the_cache(tmp_path, monkeypatch):
  from measure import host, host_calibration

  monkeypatch.setenv(host.CACHE_ENV, str(tmp_path / "env.json"))
  monkeypatch.setattr(host_calibration, "_measure", lambda quick, devices: _fake_figures())
  hw = host_calibration.hardware("host")
  assert hw.name == "host" and (tmp_path / "env.json").exists()
  assert hw.peak_bf16_tflops == pytest.approx(0.02)


def _fake_figures():
  return {
    "matmul_float32_gflops": {"256": 10.0},
    "matmul_bfloat16_gflops": {"256": 20.0},
    "memory_gb_s": 5.0,
    "memory_per_device_gib": 2.0,
    "op_overhead_us": 2.0,
    "allreduce_alpha_s": 1e-4,
    "allreduce_beta_s_per_byte": 1e-9,
    "allgather_alpha_s": 1e-4,
    "allgather_beta_s_per_byte": 1e-9,
  }
