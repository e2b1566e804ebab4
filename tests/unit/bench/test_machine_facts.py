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


def test_linear_macs_count_every_layer_linear_and_the_head_of_the_bundled_model():
    from services.engine.main import default_model_path

    loaded = machine.load_model(default_model_path())
    c = loaded.config
    per_layer = c.hidden_size * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # Q/K/V
                                 + c.num_heads * c.head_dim                        # O
                                 + 3 * c.intermediate_size)                        # gate, up, down
    macs = machine.linear_macs(loaded)
    assert macs == {"body": c.num_layers * per_layer, "head": c.vocab_size * c.hidden_size}


def test_workload_macs_count_prompt_and_fed_back_tokens_in_the_layers_and_one_head_per_new_token():
    macs = {"body": 10, "head": 3}
    # prompt of 2, 3 new tokens: 2 + 2 fed back tokens through the layers, 3 heads
    assert machine.workload_macs(macs, [2], 3) == 4 * 10 + 3 * 3
    assert machine.workload_macs(macs, [2, 5], 1) == (2 * 10 + 3) + (5 * 10 + 3)


def test_multiply_peaks_are_measured_where_the_cpu_has_avx2():
    import pytest

    if not {"avx2", "fma"} <= machine.isa.hardware_flags():
        pytest.skip("no AVX2/FMA on this CPU: the peaks are not measured")
    # with AVX2 the peaks must be measured: a missing C compiler fails here, as the kernels do
    peaks = machine.multiply_peaks_gmacs(repeats=1)
    vnni = {"int16_vnni_avx2"} if "avx_vnni" in machine.isa.cpu_flags() else set()
    assert set(peaks) == {"int16_madd_avx2", "f32_fma_avx2"} | vnni
    assert all(v > 0 for v in peaks.values())


def test_compute_use_is_each_peers_multiply_adds_over_the_better_peak():
    from bench.engine_concurrency import compute_use

    facts = {"multiply_peak_gmacs": {"int16_madd_avx2": 100.0, "f32_fma_avx2": 50.0},
             "macs_per_token": {"body": 10**9, "head": 0}, "cpu_key_flags_used": ["avx2", "fma"]}
    loads = {"c2": [[1] * 3, [1] * 3]}  # 2 streams, prompts of 3; 2 new tokens: 2 x 4 GMAC
    results = {"tokenserve": {"c2": {"tok_per_s": 20.0}}, "transformers-float32": {"c2": {"tok_per_s": 5.0}}}
    use = compute_use(results, loads, facts, new_tokens=2)
    w = use["workloads"]["c2"]
    assert use["peak_gmacs"] == 100.0 and w["gmac"] == 8.0
    assert w["bound_tok_s"] == 50.0  # 4 tokens in 8 GMAC at 100 GMAC/s: 0.08 s
    assert w["peers"]["tokenserve"] == {"gmacs": 40.0, "fraction_of_peak": 0.4}
    assert w["peers"]["transformers-float32"] == {"gmacs": 10.0, "fraction_of_peak": 0.1}
    # where the kernels may use AVX-512 the AVX2 peaks are no ceiling
    assert compute_use(results, loads, {**facts, "cpu_key_flags_used": ["avx2", "avx512f"]}, 2) is None
