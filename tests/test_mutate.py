"""The mutation tool on a toy module: a weak test lets a mutant survive, a strong one kills it."""

from __future__ import annotations

import sys

import pytest

from dev import mutate

TOY = "def clamp(x, hi):\n    if x > hi:\n        return hi\n    return x\n"


def test_each_mutant_is_one_change_and_applies():
    found = mutate.mutants(TOY)
    assert {m.what.split(":")[0] for m in found} == {"compare", "negate", "return-None"}
    swapped = [m for m in found if m.what.startswith("compare")][0]
    assert "x <= hi" in mutate.apply(TOY, swapped) and "x > hi" in TOY
    assert mutate.mutants(TOY, lines=(4, 4)) == [m for m in found if m.line == 4]


def test_a_weak_test_lets_mutants_survive_and_a_strong_one_kills_them(tmp_path, capsys):
    (tmp_path / "toy.py").write_text(TOY)
    (tmp_path / "test_weak.py").write_text("import toy\n\ndef test_it():\n    assert toy.clamp(1, 5) is not None\n")
    (tmp_path / "test_strong.py").write_text(
        "import toy\n\ndef test_it():\n    assert toy.clamp(1, 5) == 1 and toy.clamp(9, 5) == 5 and toy.clamp(5, 5) == 5\n")
    assert mutate.main(["toy.py", "--root", str(tmp_path), "--tests", "test_weak.py", "--lines", "3-3",
                        "--timeout", "60"]) == 1
    weak = capsys.readouterr().out
    assert "survived" in weak and "survivors:" in weak
    assert mutate.main(["toy.py", "--root", str(tmp_path), "--tests", "test_strong.py", "--lines", "2-2",
                        "--timeout", "60"]) == 0
    assert "2/2 mutants killed (100%)" in capsys.readouterr().out
    assert (tmp_path / "toy.py").read_text() == TOY   # the real tree is never left mutated
    assert sys.modules.get("toy") is None


WIDE = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(12))


def test_max_spreads_the_sample_and_offset_takes_a_different_one(tmp_path, capsys):
    (tmp_path / "wide.py").write_text(WIDE)
    every = [f"wide.py:{m.line}: {m.what}" for m in mutate.mutants(WIDE)]

    def listed(*extra):
        assert mutate.main(["wide.py", "--root", str(tmp_path), "--tests", "x", "--list", *extra]) == 0
        return capsys.readouterr().out.splitlines()

    assert listed() == every
    first = listed("--max", "4")
    assert len(first) == 4 and first[0] == every[0] and first[-1] == every[-1]   # the ends, spread between
    second = listed("--max", "4", "--offset", "2")
    assert len(second) == 4 and not set(first) & set(second) and set(second) <= set(every)
    assert listed("--max", "1", "--offset", "3") == [every[3]]


@pytest.mark.parametrize("extra, said", [(["--offset", "2"], "give --max N too"),
                                         (["--max", "3", "--offset", "-1"], "numbers >= 0"),
                                         (["--max", "-3"], "numbers >= 0")])
def test_an_offset_without_a_sample_or_a_negative_count_is_refused_by_name(tmp_path, capsys, extra, said):
    (tmp_path / "wide.py").write_text(WIDE)
    with pytest.raises(SystemExit) as stopped:
        mutate.main(["wide.py", "--root", str(tmp_path), "--tests", "x", "--list", *extra])
    assert stopped.value.code == 2 and said in capsys.readouterr().err
