"""Integrations with the frameworks that launch training from a config file: Axolotl's plugin
(``hf_lsce.integrations.axolotl``) and LLaMA-Factory's route (``hf_lsce.integrations.llamafactory``). Each uses its
framework's own API and hf_lsce's public one; importing hf_lsce imports neither framework."""
