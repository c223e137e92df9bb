"""LoRA adapters on the hf engine, as SGLang serves them (started with --enable-lora):
/load_lora_adapter_from_tensors loads PEFT's adapter_config and tensors under a name,
/unload_lora_adapter drops it, and a /generate naming it in `lora_path` runs with it; without
`lora_path` a request runs on the base weights.

PEFT itself applies them (`inject_adapter_in_model`, `set_peft_model_state_dict`: the code the
trainer's PEFT model runs, so the engine's log-probs are the trainer's), into the engine's
transformers model in place. Several adapters may be loaded; one generation batch runs with one
of them or none (the engine's batcher keeps batches to one `lora_path`). Every call here runs
under the engine's model lock.
"""

from __future__ import annotations

import warnings
from typing import Optional

from torch import nn

from relax_slurm.engines.hf.parsing import BadRequest

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer to an adapter route on a server started without --enable-lora."""
PEFT_CONFIG_KEYS = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "fan_in_fan_out",
                    "use_rslora", "modules_to_save", "layers_to_transform", "layers_pattern",
                    "rank_pattern", "alpha_pattern", "init_lora_weights", "task_type")
"""adapter_config.json keys that decide the adapter's layers (the rest is bookkeeping)."""


class Adapters:
    """The adapters loaded into one model, by name."""

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.model = model
        self.enabled = enabled
        self.loaded: set[str] = set()
        self.ever_loaded: set[str] = set()

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise BadRequest(NOT_ENABLED)

    def load(self, name: str, config: dict, tensors: dict) -> None:
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        self._check_enabled()
        if name in self.loaded:
            raise BadRequest(f"LoRA with name {name} already exists. Loaded LoRAs: "
                             f"{sorted(self.loaded)}")
        peft_cfg = LoraConfig(**{k: config[k] for k in PEFT_CONFIG_KEYS if k in config})
        with warnings.catch_warnings():  # several adapters in one model are what we want
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(peft_cfg, self.model, adapter_name=name)
        try:
            result = set_peft_model_state_dict(self.model, tensors, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k]
            if result.unexpected_keys or missing:
                raise BadRequest(f"adapter {name!r}: tensors do not match its config "
                                 f"(unexpected {result.unexpected_keys[:3]}, missing "
                                 f"{missing[:3]})")
        except BaseException:
            self._delete(name)
            raise
        self.loaded.add(name)
        self.ever_loaded.add(name)

    def unload(self, name: str) -> None:
        self._check_enabled()
        if name not in self.loaded:
            raise BadRequest(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                             f"{sorted(self.loaded)}")
        self._delete(name)
        self.loaded.discard(name)

    def _delete(self, name: str) -> None:
        for module in self._layers():  # the LoRA layers stay, empty: the base forward
            module.delete_adapter(name)
        # its config too: a run loads a new name every sync
        getattr(self.model, "peft_config", {}).pop(name, None)

    def _layers(self) -> list:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]

    def check_request(self, name: Optional[str]) -> None:
        """At /generate: a name never loaded is refused (SGLang's words)."""
        if name is None:
            return
        self._check_enabled()
        if name not in self.ever_loaded:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {sorted(self.loaded)}.")

    def serve(self, name: Optional[str]) -> None:
        """The next forward runs with adapter `name`, or on the base weights for None."""
        layers = self._layers()
        if name is not None and name not in self.loaded:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {sorted(self.loaded)}.")
        for module in layers:
            module.enable_adapters(name is not None)
            if name is not None:
                module.set_adapter(name)
