"""The projection of a point as the tests read it: its record as the JSON object
results.jsonl holds."""

from measure import host_calibration
from projection import project
from projection.plan import plan
from records.points import to_json


def projected(exp, hw_name: str, gpus: int, how: str = "full") -> dict:
  """`exp` on `gpus` GPUs of `hw_name`, planned and projected as `how` says."""
  target = plan(exp, host_calibration.hardware(hw_name, gpus), gpus)
  return to_json(project.project(exp, target, how))
