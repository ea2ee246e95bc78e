"""Which recording of run A a machine compares against (benchmarks/differential_run.py recording_for)."""

from benchmarks.differential_run import recording_for

AMD = {"torch": "2.13.0+cpu", "cpu_capability": "AVX512", "cpu_vendor": "AuthenticAMD"}
INTEL = {**AMD, "cpu_vendor": "GenuineIntel"}
LEGACY_AVX512 = {"machine": {"torch": "2.13.0+cpu", "cpu_capability": "AVX512"}, "name": "legacy"}
AMD_RECORDING = {"machine": AMD, "name": "amd"}


def test_a_recording_of_the_same_vendor_wins_over_one_recorded_without_a_vendor():
    assert recording_for([LEGACY_AVX512, AMD_RECORDING], AMD)["name"] == "amd"


def test_a_machine_of_another_vendor_falls_back_to_the_recording_without_a_vendor():
    assert recording_for([LEGACY_AVX512, AMD_RECORDING], INTEL)["name"] == "legacy"


def test_another_instruction_set_or_torch_has_no_recording():
    assert recording_for([LEGACY_AVX512, AMD_RECORDING], {**AMD, "cpu_capability": "AVX2"}) is None
    assert recording_for([LEGACY_AVX512, AMD_RECORDING], {**INTEL, "torch": "2.14.1"}) is None
