"""The environment switches (`ninfer.flags`): defaults, parsing, the errors a bad value gets, and that the registry
covers every NINFER_ variable the package names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ninfer import flags
from ninfer.errors import NinferError

PACKAGE = Path(flags.__file__).resolve().parent
BOOLS = [switch for switch in flags.ALL if isinstance(switch, flags.BoolSwitch)]


@pytest.fixture
def clean(monkeypatch):
    """No NINFER_ variable set: every switch at its default unless the test sets it."""
    for switch in flags.ALL:
        monkeypatch.delenv(switch.name, raising=False)
    return monkeypatch


def test_the_registry_holds_the_documented_switches_with_their_defaults(clean):
    assert {switch.name: switch.get() for switch in flags.ALL} == {
        "NINFER_PDL": True, "NINFER_BRANCHES": True, "NINFER_L2_PREFETCH_MIB": 4.0, "NINFER_STRIPES": True}
    assert (flags.PDL.name, flags.BRANCHES.name, flags.L2_PREFETCH_MIB.name, flags.STRIPES.name) == (
        "NINFER_PDL", "NINFER_BRANCHES", "NINFER_L2_PREFETCH_MIB", "NINFER_STRIPES")
    for switch in flags.ALL:
        assert switch.help.strip() and switch.get() == switch.default


@pytest.mark.parametrize("switch", BOOLS, ids=lambda s: s.name)
@pytest.mark.parametrize(("text", "value"), [("0", False), ("1", True), ("false", False), ("true", True),
                                             ("FALSE", False), ("True", True), (" 0 ", False), ("", None)])
def test_bool_switches_read_0_1_false_true_at_call_time(clean, switch, text, value):
    clean.setenv(switch.name, text)
    assert switch.get() is (switch.default if value is None else value)  # empty: as if unset


@pytest.mark.parametrize("switch", BOOLS, ids=lambda s: s.name)
@pytest.mark.parametrize("text", ["2", "yes", "off", "-1", "0.0"])
def test_a_bool_switch_refuses_other_values_naming_the_variable_and_the_accepted_ones(clean, switch, text):
    clean.setenv(switch.name, text)
    with pytest.raises(NinferError) as error:
        switch.get()
    message = str(error.value)
    assert switch.name in message and repr(text) in message and "0, 1, false, true" in message


@pytest.mark.parametrize(("text", "value"), [("2.5", 2.5), ("0", 0.0), ("16", 16.0), ("", 4.0), (" 1e1 ", 10.0)])
def test_the_l2_prefetch_budget_is_a_number_of_mib(clean, text, value):
    clean.setenv("NINFER_L2_PREFETCH_MIB", text)
    assert flags.L2_PREFETCH_MIB.get() == value


@pytest.mark.parametrize("text", ["-1", "four", "nan", "inf", "4MiB"])
def test_the_l2_prefetch_budget_refuses_what_is_not_a_finite_non_negative_number(clean, text):
    clean.setenv("NINFER_L2_PREFETCH_MIB", text)
    with pytest.raises(NinferError, match=r"NINFER_L2_PREFETCH_MIB=.*a number ≥ 0"):
        flags.L2_PREFETCH_MIB.get()


@pytest.mark.parametrize(("text", "value"), [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                             ("false", False), ("", False), (None, False)])
def test_triton_interpreted_reads_the_switch_as_triton_does(monkeypatch, text, value):
    if text is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", text)
    assert flags.triton_interpreted() is value


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def test_every_ninfer_variable_the_package_names_is_in_the_registry():
    registered = {switch.name for switch in flags.ALL}
    named = {(path.relative_to(PACKAGE).as_posix(), name) for path, text in _sources().items()
             for name in re.findall(r"\bNINFER_[A-Z0-9_]+", text)}
    assert {name for _, name in named} <= registered, sorted(entry for entry in named if entry[1] not in registered)
    assert len(registered) == len(flags.ALL)


def test_only_the_registry_reads_the_environment_for_switches():
    """No module reads a NINFER_ variable or TRITON_INTERPRET itself, and no kernel module reads the environment."""
    readers = re.compile(r"(os\.environ|os\.getenv|getenv\()")
    for path, text in _sources().items():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "flags.py":
            continue
        for line in text.splitlines():
            if readers.search(line):
                assert "NINFER_" not in line and "TRITON_INTERPRET" not in line, f"{relative}: {line.strip()}"
                assert not relative.startswith("kernels/"), f"{relative}: {line.strip()}"
