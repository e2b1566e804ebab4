"""Every benchmark JSON says which CPU it was measured on: its model name, its own flags and
the cap the run was under (machines of one flag set differ in speed)."""
from pathlib import Path

from bench import machine


def test_machine_facts_name_the_cpu_its_flags_and_the_cap():
    facts = machine.machine_facts()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = {line.partition(":")[2].strip() for line in cpuinfo.splitlines()
             if line.startswith("model name")}
    assert facts["cpu_model"] in names
    assert set(facts["cpu_key_flags"]) <= set(facts["cpu_flags"])
    assert set(facts["cpu_key_flags_used"]) <= set(facts["cpu_key_flags"])
    assert facts["isa_cap"]
    assert facts["copy_bandwidth_gbs"] > 0


def test_cpu_model_is_empty_where_proc_cpuinfo_is_unreadable(monkeypatch):
    def unreadable(self, *a, **k):
        raise OSError("no /proc here")
    monkeypatch.setattr(Path, "read_text", unreadable)
    assert machine.cpu_model() == ""
