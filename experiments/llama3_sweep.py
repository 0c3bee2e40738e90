"""The llama3 experiment's sweep (8B by default): as gpt3's, every generation, strong and
weak scaling of its FSDP layout; 2 sequences of 8,192 per replica, as GPT-3's 2 of 2,048
(a 4M-token batch at 256 replicas, Meta's Llama 2 recipe)."""

import dataclasses

from experiments import gpt3_sweep

SWEEP = dataclasses.replace(gpt3_sweep.SWEEP, token_budget=0, token_budget_label="")
