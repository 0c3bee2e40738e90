"""The cpu_char experiment's sweep: measured on 1, 2, 4 and 8 of this machine's devices."""

from sweep.definitions import measured

SWEEP = measured("train.steps=3")
