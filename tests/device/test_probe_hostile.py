"""The probe against sysroots holding what no real /proc or /sys does: it degrades, it never hangs or
loses a whole section to one odd file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from edged.hardware import probe

SYSROOTS = Path(__file__).parent.parent / "fixtures" / "sysroots"


def test_a_fifo_in_place_of_a_proc_file_is_unreadable_not_a_hang(tmp_path: Path) -> None:
    """open() on a FIFO waits for a writer: the probe (and so the daemon's start) blocked for ever."""
    shutil.copytree(SYSROOTS / "raspberry-pi-5", tmp_path / "root", symlinks=True)
    root = tmp_path / "root"
    (root / "proc" / "cpuinfo").unlink()
    os.mkfifo(root / "proc" / "cpuinfo")
    # The probe in a child process, so a regression fails the test instead of hanging the run.
    code = ("import sys; from pathlib import Path; from edged.hardware import probe; "
            "f = probe(Path(sys.argv[1]), engines=False); print(f.notes, f.memory.total_mb)")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the probe blocked on a FIFO at proc/cpuinfo") from None
    assert r.returncode == 0, r.stderr
    assert "cpu: proc/cpuinfo unreadable" in r.stdout and "None" not in r.stdout, r.stdout

def test_a_non_ascii_digit_in_the_gpu_frequency_keeps_the_jetson(tmp_path: Path) -> None:
    """'²'.isdigit() is true but int('²') raises: the whole Jetson section was lost (present = false),
    so an Orin Nano matched a CPU-only profile over one garbled attribute."""
    shutil.copytree(SYSROOTS / "jetson-orin-nano", tmp_path / "root", symlinks=True)
    root = tmp_path / "root"
    (root / "sys/class/devfreq/17000000.gpu/max_freq").write_text("\u00b2\n")
    facts = probe(root, engines=False)
    assert facts.jetson.present and facts.jetson.module == "orin-nano" and facts.jetson.soc == "tegra234"
    assert facts.jetson.gpu_sysfs == "/sys/class/devfreq/17000000.gpu"
    assert not any(n.startswith("jetson:") for n in facts.notes), facts.notes
