"""search mode: the best parallelism configurations on every --hardware x --gpus point."""

import os
import time

import tqdm

from modes.options import Options, experiment, hardware_points
from projection import search
from projection.plan import check_gpus
from records.points import ProjectedPoint
from report import points as printers
from report import results


def run(options: Options) -> list[ProjectedPoint]:
  """Search each point: every valid configuration ranked by the prior, the first
  --search_budget projected and appended, the best --top printed; every projected record."""
  points = hardware_points(options)
  for hw, gpus in points:
    check_gpus(hw, gpus)
  searches = []
  for hw, gpus in points:
    name = hw.name
    exp = experiment(options, "project", gpus=gpus, hardware=name)
    start = time.perf_counter()
    bars: list[tqdm.tqdm] = []  # made at the first projection: bad input prints nothing else

    def step(
      done: int, to_do: int, candidate: search.Candidate, bars=bars, name=name, gpus=gpus
    ) -> None:
      if not bars:
        bars.append(tqdm.tqdm(total=to_do, desc=f"searching {name} x {gpus}", unit="point"))
      bars[0].update(done - bars[0].n)
      bars[0].set_postfix_str(" ".join(candidate.assignments()[:3]))

    try:
      found = search.search(
        exp,
        hw,
        gpus,
        options.search_budget,
        # Whole: no two candidates of one search share a composed step's pieces (each is
        # its own tensor, pipeline, chunk and micro-batch), so composing would compile
        # three pieces a candidate for the two compiles of a whole one (docs/projection.md).
        "full",
        progress=step,
        on_record=lambda r: results.append(options.output_dir, r, stamp=True),
      )
      for bar in bars:
        bar.update(bar.total - bar.n)
    finally:
      for bar in bars:
        bar.close()
    searches.append((exp, found, time.perf_counter() - start))
  for exp, found, wall_s in searches:
    print(printers.search_table(exp, found, wall_s, options.top))
  print(f"\nappended to {os.path.join(options.output_dir, results.FILE)}")
  return [r for _, found, _ in searches for r in found.records]
