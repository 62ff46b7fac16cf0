"""benchmarks/kernels.py trains in one process per variant; the same variant twice must give the
same weights bit for bit (CPU training is deterministic on one machine with one set of kernels),
the caller's own kernel pins do not reach a variant, and a variant's pins reach the child: its
``capability`` is what torch reports under them."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.kernels import ROOT, largest_difference, run_variant


def test_a_variant_run_twice_trains_to_the_same_weights(tmp_path, monkeypatch):
    first = run_variant("native", 1, 1, tmp_path / "a")
    # a kernel pin in the caller's environment is cleared for a variant that sets none
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    again = run_variant("native again", 1, 1, tmp_path / "b")
    assert again["capability"] == first["capability"]
    assert first["digest"] == again["digest"]
    assert largest_difference(first["weights"], again["weights"]) == 0.0
    assert first["loss"] == again["loss"] and first["threads"] == 1


def test_the_pinned_kernels_reach_the_child(tmp_path):
    # torch reports the capability ATEN_CPU_CAPABILITY chose, on any CPU ("default": no vectors)
    pinned = run_variant("ATen default (scalar)", 1, 1, tmp_path)
    assert pinned["capability"] == "DEFAULT"


def test_bad_arguments_exit_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--variants", "native", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
