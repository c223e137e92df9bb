"""Which adapter a LoRA policy's /generate names (engines/served_adapter.py): pure parts. The
engines' side is tests/unit/engines/hf/test_lora.py and the real SGLang's
tests/integration/test_sglang_cpu_e2e.py."""

from relax_slurm.engines.client import GenerateResult
from relax_slurm.engines.served_adapter import (ServedAdapter, adapter_name, names_missing,
                                                names_present, stamped)


def test_the_newest_of_the_engines_label_and_the_announced_version_is_named():
    announced = [None]
    adapter = ServedAdapter(lambda: announced[0])
    assert adapter.version() is None  # nothing known: the client asks the engine
    adapter.note("default")  # SGLang's label before any update
    assert adapter.version() is None
    adapter.note("3")
    adapter.note("2")  # an older answer, finished late, does not move it back
    assert adapter.version() == 3
    announced[0] = 5
    assert adapter.version() == 5 and adapter_name(5) == "policy-v5"
    adapter.forget()
    announced[0] = None
    assert adapter.version() is None


def test_an_answer_is_stamped_with_the_version_it_named_not_the_engines_label():
    res = GenerateResult([1, 2], [-0.1, -0.2], "stop", "7",
                         weight_versions=[("6", 0, 1), ("7", 1, 2)])
    (out,) = stamped([res], 6)
    assert out.weight_version == "6" and out.weight_versions == [] and out.versions() == [6]


def test_sglangs_refusals_are_read():
    # SGLang 0.5.23's words (lora_registry.py, tokenizer_manager.py, lora_manager.py)
    assert names_missing("Got LoRA adapter that has never been loaded: policy-v3")
    assert names_missing("The following requested LoRA adapters are not loaded: policy-v3")
    assert names_missing("Failed to implicitly load LoRA adapter policy-v3: ...")
    assert names_missing("LoRA with name policy-v3 does not exist. Loaded LoRAs: ...")
    assert names_present("Failed to load LoRA adapter policy-v3 because it is already loaded")
    assert names_present("LoRA with name policy-v3 already exists. Loaded LoRAs: ...")
    assert not names_missing("HTTP 500: CUDA out of memory")
