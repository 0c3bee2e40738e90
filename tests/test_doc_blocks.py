"""report/doc_blocks.py: a generated block is replaced in place, nothing else changes."""

import pytest

from report import doc_blocks

SOURCE = "benchmarks/mlperf.py --benchmark=gpt3 calibration"
BEGIN, END = doc_blocks.markers(SOURCE)
OTHER_BEGIN, OTHER_END = doc_blocks.markers("benchmarks/mlperf.py --benchmark=llama calibration")

DOC = (
  "# Title\n\nProse  with trailing spaces   \n\n"
  f"{BEGIN}\n| a |\n|---|\n| 1 |\n{END}\n"
  "\nMore prose.\n"
  f"{OTHER_BEGIN}\nother table\n{OTHER_END}\n"
  "no final newline"
)


def test_replaces_only_its_block() -> None:
  new = doc_blocks.replace_block(DOC, SOURCE, "| a |\n|---|\n| 2 |")
  before, after = DOC.split(BEGIN)[0], DOC.split(END)[1]
  assert new == f"{before}{BEGIN}\n| a |\n|---|\n| 2 |\n{END}{after}"
  assert new.startswith(before) and new.endswith(after)  # byte-identical outside


def test_replacing_twice_is_replacing_once() -> None:
  once = doc_blocks.replace_block(DOC, SOURCE, "x\n")
  assert doc_blocks.replace_block(once, SOURCE, "x\n") == once
  assert doc_blocks.replace_block(once, SOURCE, "| a |\n|---|\n| 1 |\n") == DOC


def test_empty_body() -> None:
  assert f"{BEGIN}\n{END}\n" in doc_blocks.replace_block(DOC, SOURCE, "")


@pytest.mark.parametrize(
  "text, message",
  [
    ("# no markers\n", "no marker"),
    (f"{BEGIN}\nx\n", "no marker"),
    (f"{BEGIN}\n{END}\n{BEGIN}\n{END}\n", "occurs 2 times"),
    (f"{END}\nx\n{BEGIN}\n", "comes before"),
    (f"text {BEGIN}\nx\n{END}\n", "line of its own"),
  ],
)
def test_refuses_bad_markers(text: str, message: str) -> None:
  with pytest.raises(doc_blocks.MarkerError, match=message):
    doc_blocks.replace_block(text, SOURCE, "y\n")


def test_write_block(tmp_path) -> None:
  path = tmp_path / "doc.md"
  path.write_bytes(DOC.encode())
  assert doc_blocks.write_block(str(path), SOURCE, "z\n")
  assert path.read_text() == doc_blocks.replace_block(DOC, SOURCE, "z\n")
  assert not doc_blocks.write_block(str(path), SOURCE, "z\n")  # unchanged: not rewritten
  (tmp_path / "bad.md").write_text("nothing here\n")
  with pytest.raises(doc_blocks.MarkerError):
    doc_blocks.write_block(str(tmp_path / "bad.md"), SOURCE, "z\n")
  assert (tmp_path / "bad.md").read_text() == "nothing here\n"


def test_markdown_table() -> None:
  assert doc_blocks.markdown_table(("a", "b"), [("1", "2")]) == "| a | b |\n|---|---|\n| 1 | 2 |\n"


def test_closing_the_loop_writes_its_table_as_a_block() -> None:
  from benchmarks import closing_the_loop  # pylint: disable=import-outside-toplevel

  point = closing_the_loop.POINTS[2]
  result = closing_the_loop.Result(point, 0.10, 0.09, 0.08, None)
  body = closing_the_loop.markdown([result], 20, (1.0, 2.0))
  assert "| fsdp 2 | 2 | 0.1000 | 0.0800 | -20.0% | 0.0900 | -11.1% |" in body
  assert "1 of 1 within 25% of the measured median" in body
  with open(closing_the_loop.DOC, encoding="utf-8") as f:  # the doc holds the block
    text = f.read()
  assert doc_blocks.replace_block(text, closing_the_loop.DOC_SOURCE, body).count(body) == 1
