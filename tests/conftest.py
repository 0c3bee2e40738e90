"""Tests run on 8 host CPU devices, configured before anything imports jax."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)
