"""Model shapes the CPU tests share: small enough to compile in seconds on 8 host devices,
with every feature of the architecture they stand for."""

import dataclasses

from model.config import preset

# llama3-tiny's architecture, smaller: 4 query heads sharing 2 K/V heads of 8, rotary
# positions, SwiGLU; T = 16 and D = 32 make activation shapes recognisable in the HLO.
SMALL_LLAMA = dataclasses.replace(
  preset("llama3-tiny"), d_model=32, head_dim=8, ffn_dim=64, seq_len=16, vocab_size=128
)
