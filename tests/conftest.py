"""Tests run on 8 host CPU devices, configured before anything imports jax.

Compiled programs are cached for the session in a fresh directory, shared with the
launch.py subprocesses the tests start (they inherit the environment): many tests compile
the same small programs again (a checkpoint resumed, a run repeated on other processes),
and the suite must stay under 10 minutes on 2 cores. A fresh directory each session keeps
one run's compiles from standing in for the next's.
"""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-scaling-tests-")
atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)
