"""PyTorch eager reference for benchmarks/cpu_perf.py: a nanoGPT-style GPT train step.

The same model as model/gpt.py (learned positions, pre-LayerNorm, tanh-GELU MLP 4x,
causal attention through `scaled_dot_product_attention`, tied embeddings, biases) and the
same update (AdamW with decay on matrices only, global-norm clipping at 1.0), float32,
written the way nanoGPT writes it: one eager step, no torch.compile. Measurement only:
torch is not a dependency of this project.

Run as a worker so that its steps interleave with JAX's in one benchmark run: it builds
the model, runs two warm-up steps, prints one JSON line ({"ready": ...}), then for each
line N on stdin runs N timed steps and prints {"step_times_s": [...]}. EOF ends it.
"""

import argparse
import json
import math
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
  def __init__(self, d_model: int, num_heads: int):
    super().__init__()
    self.num_heads = num_heads
    self.ln1 = nn.LayerNorm(d_model)
    self.qkv = nn.Linear(d_model, 3 * d_model)
    self.out = nn.Linear(d_model, d_model)
    self.ln2 = nn.LayerNorm(d_model)
    self.fc1 = nn.Linear(d_model, 4 * d_model)
    self.fc2 = nn.Linear(4 * d_model, d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
    q, k, v = (t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.out(a.transpose(1, 2).contiguous().view(B, T, D))
    return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  def __init__(self, num_layers: int, d_model: int, num_heads: int, seq_len: int, vocab: int):
    super().__init__()
    self.wte = nn.Embedding(vocab, d_model)
    self.wpe = nn.Embedding(seq_len, d_model)
    self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
    self.lnf = nn.LayerNorm(d_model)
    self.head = nn.Linear(d_model, vocab, bias=False)
    self.head.weight = self.wte.weight
    for name, p in self.named_parameters():
      if name.endswith(("out.weight", "fc2.weight")):
        nn.init.normal_(p, std=0.02 / math.sqrt(2 * num_layers))
      elif p.dim() == 2:
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    logits = self.head(self.lnf(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  for name in ("num_layers", "d_model", "num_heads", "seq_len", "vocab", "batch"):
    parser.add_argument(f"--{name}", type=int, required=True)
  parser.add_argument("--learning_rate", type=float, default=6e-4)
  args = parser.parse_args()
  torch.manual_seed(0)
  model = GPT(args.num_layers, args.d_model, args.num_heads, args.seq_len, args.vocab)
  matrices = [p for p in model.parameters() if p.dim() >= 2]
  vectors = [p for p in model.parameters() if p.dim() < 2]
  opt = torch.optim.AdamW(
    [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
    lr=args.learning_rate,
    betas=(0.9, 0.95),
    eps=1e-8,
  )
  shape = (args.batch, args.seq_len)

  def step() -> float:
    tokens, targets = torch.randint(0, args.vocab, shape), torch.randint(0, args.vocab, shape)
    start = time.perf_counter()
    loss = model(tokens, targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - start

  for _ in range(2):
    step()
  print(
    json.dumps({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads()}),
    flush=True,
  )
  for line in sys.stdin:
    print(json.dumps({"step_times_s": [step() for _ in range(int(line))]}), flush=True)


if __name__ == "__main__":
  main()
