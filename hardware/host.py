"""Profile of the machine the code runs on, as a `Hardware` entry.

Lets the projection be checked end to end on CPU: compile a small model on N emulated
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), predict its step
with this profile, and compare with the measured step. The emulated "node" is the N
local devices; they share the cores and memory, so every figure is measured with all
N devices busy at once and reported per device.

Measured with JAX on the CPU devices (a ~5-15 s micro-benchmark, run once per machine
and cached as JSON keyed by machine identity):
  - matmul FLOP/s per dtype (float32, bfloat16) at a few sizes,
  - memory bandwidth (a large elementwise add: read + write),
  - per-op overhead (a chain of tiny dependent dots, the analogue of a kernel launch),
  - all-reduce (psum) and all-gather over a mesh of all local devices at a few sizes,
    fitted to t = alpha + beta * bytes (bytes per device as in projection/collectives).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hardware.catalog import Hardware, Protocol

FORMAT_VERSION = 1
CACHE_ENV = "JAX_SCALING_HOST_PROFILE"  # overrides the cache file path
DEFAULT_CACHE = Path.home() / ".cache" / "jax-scaling" / "host_profile.json"

_FULL = dict(matmul=(128, 256, 512), mem_mib=16, coll_kib=(64, 512, 4096), reps=5)
_QUICK = dict(matmul=(64, 128), mem_mib=2, coll_kib=(16, 128, 512), reps=3)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def host_profile(refresh: bool = False, *, cache_path: str | os.PathLike | None = None,
                 quick: bool = False) -> Hardware:
    """This machine as a `Hardware` (name 'host'), measured once and cached.

    refresh: measure again even if cached. cache_path: JSON file (default
    $JAX_SCALING_HOST_PROFILE or ~/.cache/jax-scaling/host_profile.json). quick: a
    smaller, noisier benchmark (~2-5 s) for tests; a cached full profile satisfies a
    quick request, not the other way round.
    """
    path = Path(cache_path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
    identity = machine_identity()
    key = _identity_key(identity)
    cache = _read_cache(path)
    entry = cache["profiles"].get(key)
    if refresh or entry is None or (entry.get("quick") and not quick):
        t0 = time.perf_counter()
        figures = _measure(quick)
        entry = {"identity": identity, "quick": quick,
                 "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "duration_s": round(time.perf_counter() - t0, 2), "figures": figures}
        cache["profiles"][key] = entry
        _write_cache(path, cache)
    return profile_to_hardware(entry)


def machine_identity() -> dict[str, Any]:
    """What the cached profile is valid for: cpu model, cores, jax version, devices."""
    import jax

    return {"cpu_model": _cpu_model(), "cpu_count": os.cpu_count() or 1,
            "jax_version": jax.__version__, "device_count": len(jax.devices("cpu"))}


def profile_to_hardware(entry: dict[str, Any]) -> Hardware:
    """Map a cache entry (identity + measured figures) onto the catalog's type."""
    ident, f = entry["identity"], entry["figures"]
    n = int(ident["device_count"])
    ar_busbw = _busbw_from_beta(f["allreduce_beta_s_per_byte"], 2.0 * (n - 1) / n, f)
    ag_busbw = _busbw_from_beta(f["allgather_beta_s_per_byte"], (n - 1) / n, f)
    mm = {dt: f[f"matmul_{dt}_gflops"] for dt in ("float32", "bfloat16")}
    src = f"measured by hardware/host.py at {entry['measured_at']} ({entry['duration_s']} s)"
    measured = {name: src for name in (
        "peak_bf16_tflops", "achievable_bf16_tflops", "peak_f32_tflops",
        "achievable_f32_tflops", "hbm_peak_tb_s", "nvlink_gb_s", "allreduce_ring_busbw_gb_s",
        "allgather_busbw_gb_s", "nic_gbit_s", "nic_achievable_gb_s", "protocols",
        "kernel_launch_us")}
    return Hardware(
        name="host",
        description=f"{ident['cpu_model']}, {ident['cpu_count']} cores, "
                    f"{n} emulated JAX CPU devices (jax {ident['jax_version']})",
        gpus_per_node=n, nvlink_domain_size=n,
        # Peak = best size seen; achievable = the largest size (the "large GEMM").
        peak_bf16_tflops=max(mm["bfloat16"].values()) / 1e3, peak_fp8_tflops=None,
        achievable_bf16_tflops=_largest(mm["bfloat16"]) / 1e3, achievable_fp8_tflops=None,
        peak_f32_tflops=max(mm["float32"].values()) / 1e3,
        achievable_f32_tflops=_largest(mm["float32"]) / 1e3,
        hbm_gib=f["memory_per_device_gib"], hbm_peak_tb_s=f["memory_gb_s"] / 1e3,
        hbm_achievable_fraction=1.0,  # already a measurement
        nvlink_gb_s=ar_busbw, nvlink_sharp=False,
        allreduce_ring_busbw_gb_s=ar_busbw, allreduce_nvls_busbw_gb_s=None,
        allgather_busbw_gb_s=ag_busbw,
        # No real network: devices of another emulated "node" are in the same process,
        # reached through the same memory, so the "NIC" is the in-process link.
        nics_per_gpu=1, nic_gbit_s=ar_busbw * 8, nic_achievable_gb_s=ar_busbw,
        # The fitted alpha is the whole-call latency; there are no per-hop terms to
        # separate with a single group size.
        protocols=(Protocol("measured", base_us=f["allreduce_alpha_s"] * 1e6, nvlink_hop_us=0.0,
                            net_hop_us=0.0, tree_net_hop_us=0.0, bandwidth_fraction=1.0),),
        nvls_latency_us=None, kernel_launch_us=f["op_overhead_us"],
        sources={**measured,
                 "gpus_per_node": "JAX CPU device count",
                 "nvlink_domain_size": "JAX CPU device count",
                 "hbm_gib": "physical memory / device count",
                 "hbm_achievable_fraction": "1.0: the bandwidth is measured",
                 "nvlink_sharp": "no in-network reduction on a CPU",
                 "nics_per_gpu": "in-process link stands in for a NIC",
                 "nvls_latency_us": "no NVLS"},
    )


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _measure(quick: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cfg = _QUICK if quick else _FULL
    devices = jax.devices("cpu")
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharded = NamedSharding(mesh, P("d"))

    def per_device(fn: Callable) -> Callable:
        # The same local computation on every device at once: the emulated node busy.
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def timed(fn: Callable, x) -> float:
        return _best_time_s(fn, x, cfg["reps"])

    figures: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        gflops = {}
        for size in cfg["matmul"]:
            a = jnp.ones((n, size, size), dtype, device=sharded)
            t = timed(per_device(lambda x: x @ x), a)
            gflops[str(size)] = 2.0 * size**3 / t / 1e9
        figures[f"matmul_{dtype}_gflops"] = gflops

    elems = cfg["mem_mib"] * 2**20 // 4
    x = jnp.ones((n, elems), jnp.float32, device=sharded)
    t = timed(per_device(lambda v: v + 1.0), x)
    figures["memory_gb_s"] = 2.0 * elems * 4 / t / 1e9  # read + write, per device
    figures["memory_per_device_gib"] = _physical_memory_bytes() / n / 2**30

    figures["op_overhead_us"] = _op_overhead_s(jax, jnp, cfg["reps"]) * 1e6

    if n > 1:
        # float32 elements per device, a multiple of n so all-gather shards evenly.
        elems = [kib * 1024 // 4 // n * n for kib in cfg["coll_kib"]]
        sizes = [e * 4 for e in elems]
        psum = per_device(lambda v: jax.lax.psum(v, "d"))
        gather = per_device(lambda v: jax.lax.all_gather(v, "d", tiled=True))
        ar_t, ag_t = [], []
        for e in elems:
            # psum: operand e elements per device; all-gather: OUTPUT e elements per
            # device (input e/n), the byte conventions of projection/collectives.
            ar_t.append(timed(psum, jnp.ones((n, e), jnp.float32, device=sharded)))
            ag_t.append(timed(gather, jnp.ones((e,), jnp.float32, device=sharded)))
        for name, ts in (("allreduce", ar_t), ("allgather", ag_t)):
            alpha, beta = _fit_alpha_beta(sizes, ts)
            figures[f"{name}_alpha_s"], figures[f"{name}_beta_s_per_byte"] = alpha, beta
            figures[f"{name}_points"] = [[s, t] for s, t in zip(sizes, ts)]
    else:  # one device: nothing to communicate; a "collective" is a memory copy
        for name in ("allreduce", "allgather"):
            figures[f"{name}_alpha_s"] = figures["op_overhead_us"] * 1e-6
            figures[f"{name}_beta_s_per_byte"] = 1.0 / (figures["memory_gb_s"] * 1e9)
    return figures


def _best_time_s(fn: Callable, x, reps: int) -> float:
    """Minimum wall time over `reps` calls after one warm-up (compile) call: the
    minimum is the least noisy estimate of the cost on a shared machine."""
    fn(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def _op_overhead_s(jax, jnp, reps: int) -> float:
    """Per-op cost of a tiny op inside one program: a chain of K dependent 8x8 dots
    (dots do not fuse), (t_K - t_1) / (K - 1) removes the dispatch cost."""
    k = 64

    def chain(steps: int) -> Callable:
        def f(x):
            for _ in range(steps):
                x = jnp.tanh(x @ x)
            return x
        return jax.jit(f)

    x = jnp.full((8, 8), 0.1, jnp.float32)
    t1 = _best_time_s(chain(1), x, reps * 4)
    tk = _best_time_s(chain(k), x, reps * 4)
    if tk > t1:
        return (tk - t1) / (k - 1)
    return tk / k  # noise swamped the difference: an upper bound instead


def _fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least-squares t = alpha + beta * bytes; clamped positive (noise on a loaded
    machine can tilt the line; a collective never gets cheaper with more bytes)."""
    beta, alpha = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
    if beta <= 0:  # flat or noisy: bandwidth from the largest point
        beta = times[-1] / sizes[-1]
    alpha = max(float(alpha), 1e-7)
    return alpha, float(beta)


def _busbw_from_beta(beta_s_per_byte: float, factor: float, f: dict[str, Any]) -> float:
    """Bus bandwidth (GB/s) implied by the fitted slope: t = factor x S / B."""
    if factor <= 0:  # one device: no link; use memory bandwidth
        return f["memory_gb_s"]
    return factor / beta_s_per_byte / 1e9


def _largest(by_size: dict[str, float]) -> float:
    return by_size[max(by_size, key=int)]


# ---------------------------------------------------------------------------
# Identity and cache
# ---------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _identity_key(identity: dict[str, Any]) -> str:
    return "|".join(f"{k}={identity[k]}" for k in sorted(identity))


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT_VERSION and isinstance(data.get("profiles"), dict):
            return data
    except (OSError, ValueError):
        pass
    return {"format": FORMAT_VERSION, "profiles": {}}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: concurrent readers never see half a file
