"""Jetson accelerator metrics from sysfs: GPU load and clocks, the memory controller, power rails.

Where the files live differs between L4T releases; every reader tries the known places
in order (newest first) and returns None or an empty list when none is there:

* GPU: the devfreq node named like ``17000000.ga10b`` / ``.gv11b`` / ``.gpu`` (clocks in Hz:
  ``cur_freq``, ``min_freq``, ``max_freq``) and the GPU device's ``load`` (per mille, 0-1000),
  found at ``<devfreq>/device/load`` or ``/sys/devices[/platform[/bus@0]]/<node>/load``.
* EMC: ``/sys/kernel/debug/bpmp/debug/clk/emc/rate`` (Orin) or ``/sys/kernel/debug/clk/emc/clk_rate``
  (older), both in Hz and readable by root only; utilisation is the activity monitor's
  ``/sys/kernel/actmon_avg_activity/mc_all`` (kHz of busy cycles) over the EMC clock in kHz,
  as tegrastats computes it.
* Power rails: the INA3221 monitor, as a hwmon device (JetPack 5 and later: ``in<N>_label``,
  ``in<N>_input`` mV, ``curr<N>_input`` mA) or as an IIO device (JetPack 4: ``rail_name_<N>``,
  ``in_voltage<N>_input`` mV, ``in_current<N>_input`` mA, ``in_power<N>_input`` mW).
"""

from __future__ import annotations

import re

from edged.telemetry.readings import AcceleratorReading, EmcReading, RailReading
from edged.telemetry.sysfs import SysRoot

_GPU_NODE = re.compile(r"^[0-9a-f]+\.(gpu|ga10b|gv11b|gp10b|gm20b)$")
_DEVICE_BASES = ("sys/devices/platform/bus@0", "sys/devices/platform", "sys/devices")
_EMC_RATE = ("sys/kernel/debug/bpmp/debug/clk/emc/rate", "sys/kernel/debug/clk/emc/clk_rate",
             "sys/kernel/debug/tegra_bwmgr/emc_rate")
_EMC_ACTIVITY = "sys/kernel/actmon_avg_activity/mc_all"
_HWMON_IN = re.compile(r"^in(\d+)_label$")
_IIO_RAIL = re.compile(r"^rail_name_(\d+)$")


def _gpu_nodes(sr: SysRoot) -> list[tuple[str, str, list[str]]]:
    """(node name, devfreq folder, candidate load files) for each Jetson GPU."""
    out: list[tuple[str, str, list[str]]] = []
    for name in sr.listdir("sys/class/devfreq"):
        if _GPU_NODE.fullmatch(name):
            node = f"sys/class/devfreq/{name}"
            out.append((name, node, [f"{node}/device/load"] + [f"{b}/{name}/load" for b in _DEVICE_BASES]))
    if out:
        return out
    for base in _DEVICE_BASES:
        for name in sr.listdir(base):
            if _GPU_NODE.fullmatch(name) and sr.is_dir(f"{base}/{name}/devfreq/{name}"):
                out.append((name, f"{base}/{name}/devfreq/{name}", [f"{base}/{name}/load"]))
        if out:
            break
    return out


def read_gpus(sr: SysRoot) -> list[AcceleratorReading]:
    gpus = []
    for name, node, load_files in _gpu_nodes(sr):
        load = next((v for v in (sr.read_int(f) for f in load_files) if v is not None), None)

        def hz(rel: str) -> float | None:
            v = sr.read_int(rel)
            return float(v) if v is not None else None

        gpus.append(AcceleratorReading(
            name=name, kind="jetson-gpu",
            utilization=min(max(load / 1000.0, 0.0), 1.0) if load is not None else None,
            freq_hz=hz(f"{node}/cur_freq"), min_freq_hz=hz(f"{node}/min_freq"), max_freq_hz=hz(f"{node}/max_freq"),
        ))
    return gpus


def read_emc(sr: SysRoot) -> EmcReading | None:
    """None without the EMC clock (debugfs is root-only): the activity count alone has no scale."""
    rate = next((v for v in (sr.read_int(f) for f in _EMC_RATE) if v), None)
    if rate is None:
        return None
    activity_khz = sr.read_int(_EMC_ACTIVITY)
    util = min(max(activity_khz / (rate / 1000.0), 0.0), 1.0) if activity_khz is not None else None
    return EmcReading(freq_hz=float(rate), utilization=util)


def _hwmon_rails(sr: SysRoot) -> list[RailReading]:
    folders = [f"sys/class/hwmon/{h}" for h in sr.listdir("sys/class/hwmon")]
    for dev in sr.listdir("sys/bus/i2c/drivers/ina3221"):
        folders += [f"sys/bus/i2c/drivers/ina3221/{dev}/hwmon/{h}" for h in
                    sr.listdir(f"sys/bus/i2c/drivers/ina3221/{dev}/hwmon")]
    rails = []
    for folder in folders:
        if sr.read(f"{folder}/name") != "ina3221":
            continue
        for entry in sr.listdir(folder):
            m = _HWMON_IN.fullmatch(entry)
            label = sr.read(f"{folder}/{entry}") if m else None
            if not m or not label or label.lower().startswith("sum of"):
                continue
            n = m.group(1)
            mv, ma = sr.read_int(f"{folder}/in{n}_input"), sr.read_int(f"{folder}/curr{n}_input")
            v = mv / 1000.0 if mv is not None else None
            a = ma / 1000.0 if ma is not None else None
            rails.append(RailReading(name=label, voltage_v=v, current_a=a,
                                     power_w=v * a if v is not None and a is not None else None))
    return rails


def _iio_rails(sr: SysRoot) -> list[RailReading]:
    rails = []
    for dev in sr.listdir("sys/bus/i2c/drivers/ina3221x"):
        for iio in sr.listdir(f"sys/bus/i2c/drivers/ina3221x/{dev}"):
            if not iio.startswith("iio:device"):
                continue
            folder = f"sys/bus/i2c/drivers/ina3221x/{dev}/{iio}"
            for entry in sr.listdir(folder):
                m = _IIO_RAIL.fullmatch(entry)
                label = sr.read(f"{folder}/{entry}") if m else None
                if not m or not label:
                    continue
                n = m.group(1)
                mv, ma, mw = (sr.read_int(f"{folder}/in_{q}{n}_input") for q in ("voltage", "current", "power"))
                rails.append(RailReading(name=label, voltage_v=mv / 1000.0 if mv is not None else None,
                                         current_a=ma / 1000.0 if ma is not None else None,
                                         power_w=mw / 1000.0 if mw is not None else None))
    return rails


def read_rails(sr: SysRoot) -> list[RailReading]:
    seen: set[str] = set()
    out = []
    for rail in _hwmon_rails(sr) + _iio_rails(sr):
        if rail.name not in seen:
            seen.add(rail.name)
            out.append(rail)
    return out
