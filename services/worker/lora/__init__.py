"""LoRA adapters in the worker: PEFT folders loaded to host memory (`adapter.py`, `cpu_cache.py`), copied
into the layers' fixed slots (`slots.py`), and added per request segment by the LoRA layers around the
base linear layers (`layers.py`), all tied together per step by `LoRAManager` (`manager.py`)."""
