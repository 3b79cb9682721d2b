"""The one result writer: every benchmark and simulator command's JSON carries the same
envelope (command, git commit, machine with its ISA flags and load, roofline), and the committed
results stay readable by the commands that replaced the scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everystop.cli import main
from everystop.results import write_result

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
ENVELOPE = {"command", "git_commit", "machine", "roofline"}


def test_write_result_wraps_the_result_in_the_envelope(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sub" / "r.json"
    written = write_result({"tok_s": 1.5, "machine": {"torch_threads": 2}}, out,
                           roofline={"bound": "compute"})
    assert json.loads(out.read_text()) == written == json.loads(capsys.readouterr().out)
    assert set(written) == ENVELOPE | {"tok_s"}
    machine = written["machine"]
    assert machine["torch_threads"] == 2 and len(machine["load_avg"]) == 3
    assert isinstance(machine["isa_flags"], list) and machine["cpus"] >= 1
    assert machine["python"].startswith(("cpython 3.", "pypy 3."))
    assert written["roofline"] == {"bound": "compute"}
    assert written["git_commit"] is None or len(written["git_commit"].split("+")[0]) == 40


def test_roofline_annotates_a_committed_throughput_result(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "roofline.json"
    argv = ["bench", "roofline", "--peaks", str(RESULTS / "roofline.json"),
            str(RESULTS / "cpu" / "amd_avx512" / "throughput.json"), "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["/venv/bin/everystop", *argv])
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) >= ENVELOPE and report["command"].startswith("everystop bench roofline")
    (annotated,) = report["results"].values()
    assert 0 < annotated["mfu"] < 1 and annotated["bound"] in ("compute", "weight bandwidth")


def test_simulate_calibrate_self_test_reproduces_the_committed_calibration(
        tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    assert main(["simulate", "calibrate", "--self-test", "--out", str(out)]) == 0
    new = json.loads(out.read_text())
    committed = json.loads((RESULTS / "sim" / "calibration.json").read_text())
    assert new.keys() - ENVELOPE == committed.keys() - ENVELOPE
    assert new["predicted"] == committed["predicted"]
    for key, value in committed["fitted_coefficients"].items():
        assert new["fitted_coefficients"][key] == pytest.approx(value, rel=1e-9)


def test_every_committed_result_carries_the_envelope() -> None:
    """Every committed result came through write_result, so each says how it was made."""
    paths = sorted(RESULTS.rglob("*.json"))
    assert paths, f"no committed results under {RESULTS}"
    without = []
    for path in paths:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and set(data) >= ENVELOPE):
            without.append(path.relative_to(RESULTS).as_posix())
    assert not without, f"written without write_result's envelope (rerun them): {without}"


def test_cpu_id_names_the_family_and_model_the_model_name_may_hide(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two machines both called "AMD EPYC" by a VM differ ~2x in pure Python speed: the result
    names the CPU's family, model and stepping as /proc/cpuinfo gives them (the first CPU's)."""
    import builtins

    from everystop import results

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "model\t\t: 17\nmodel name\t: AMD EPYC\nstepping\t: 1\n"
                    "flags\t\t: fpu avx2 fma\n\nprocessor\t: 1\ncpu family\t: 23\n"
                    "model\t\t: 49\nstepping\t: 0\n")
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real_open(fake if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(results.platform, "processor", lambda: "")
    info = results.cpu_info()
    assert info["model"] == "AMD EPYC"
    assert info["cpu_id"] == "family 25 model 17 stepping 1"
    assert info["isa_flags"] == ["avx2", "fma"]
    fake.write_text("processor\t: 0\nflags\t\t: fpu\n")  # no ids (e.g. an ARM machine)
    assert "cpu_id" not in results.cpu_info()
