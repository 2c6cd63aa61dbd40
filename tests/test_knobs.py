"""cpu_kernels.knobs: the one list of HYBRID_* environment variables, parsed once, a bad value in one line."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cpu_kernels import knobs
from cpu_kernels.knobs import KNOB, KNOBS, BadKnob, Knobs, parse

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FLOORS = ("cpu_kernels", "placement", "hybrid", "bench")


def test_defaults():
    k = parse({})
    assert (k.cpu_isa, k.hugepages, k.spin_us, k.core_split, k.fused_decode, k.no_progress, k.api_key) == \
        (None, True, 2000, True, "auto", False, None)
    assert k.cache == Path.home() / ".cache" / "hybrid"


def test_the_documented_defaults_are_the_defaults():
    for k in KNOBS:
        if k.default:
            assert parse({k.name: k.default}) == parse({}), k.name


def test_values_of_each_kind():
    k = parse({"HYBRID_CPU_ISA": " avx2 ", "HYBRID_HUGEPAGES": "0", "HYBRID_SPIN_US": "0", "HYBRID_CORE_SPLIT": "0",
               "HYBRID_FUSED_DECODE": "Off", "HYBRID_CACHE": "/tmp/hy", "HYBRID_NO_PROGRESS": "1",
               "HYBRID_API_KEY": "s3cret", "HYBRID_UNRELATED": "x", "PATH": "/bin"})
    assert (k.cpu_isa, k.hugepages, k.spin_us, k.core_split, k.fused_decode, k.no_progress, k.api_key) == \
        ("avx2", False, 0, False, "0", True, "s3cret")
    assert k.cache == Path("/tmp/hy")
    assert parse({"HYBRID_FUSED_DECODE": "yes"}).fused_decode == "1"
    assert parse({"HYBRID_HUGEPAGES": "  "}).hugepages is True  # empty means the default
    assert "s3cret" not in repr(k)  # the key never reaches a log line through the dataclass


@pytest.mark.parametrize("name,raw,message", [
    ("HYBRID_HUGEPAGES", "yes", "HYBRID_HUGEPAGES must be 0 or 1, not 'yes'"),
    ("HYBRID_NO_PROGRESS", "true", "HYBRID_NO_PROGRESS must be 0 or 1, not 'true'"),
    ("HYBRID_SPIN_US", "-1", "HYBRID_SPIN_US must be a whole number >= 0, not '-1'"),
    ("HYBRID_SPIN_US", "2ms", "HYBRID_SPIN_US must be a whole number >= 0, not '2ms'"),
    ("HYBRID_FUSED_DECODE", "maybe", "HYBRID_FUSED_DECODE must be one of auto, 0, 1, not 'maybe'"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, raw, message):
    with pytest.raises(BadKnob) as err:
        parse({name: raw})
    assert str(err.value) == message and "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_list_and_the_dataclass_agree():
    assert [k.attr for k in KNOBS] == [f.name for f in dataclasses.fields(Knobs)]
    assert len(KNOB) == len(KNOBS) and all(k.name.startswith("HYBRID_") for k in KNOBS)
    assert all(k.meaning.endswith(".") and k.kind in ("bool", "count", "choice", "path", "text", "secret")
               for k in KNOBS)
    table = knobs.table().splitlines()
    assert len(table) == 2 + len(KNOBS) and all(f"`{k.name}`" in row for k, row in zip(KNOBS, table[2:]))


def test_read_once_until_reset(monkeypatch):
    monkeypatch.setenv("HYBRID_SPIN_US", "7")
    knobs.reset()
    first = knobs.knobs()
    assert first.spin_us == 7
    monkeypatch.setenv("HYBRID_SPIN_US", "9")
    assert knobs.knobs() is first  # cached: a setting never changes half way through a run
    knobs.reset()
    assert knobs.knobs().spin_us == 9


def _source_files():
    for floor in SOURCE_FLOORS:
        yield from (p for p in (ROOT / floor).rglob("*.py") if "results" not in p.parts)


def test_every_variable_named_in_the_code_is_a_knob():
    """A HYBRID_* name in the code that is not in the list is a retired option's leftover or an unlisted knob."""
    unknown = {}
    for path in _source_files():
        for name in set(re.findall(r"\bHYBRID_[A-Z][A-Z0-9_]*", path.read_text())):
            if name not in KNOB:
                unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert unknown == {}


def test_only_the_knobs_module_reads_them():
    read = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*['"]HYBRID_""")
    readers = [str(p.relative_to(ROOT)) for p in _source_files() if read.search(p.read_text())]
    assert readers == []
