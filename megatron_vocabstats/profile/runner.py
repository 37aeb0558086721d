"""Moved: the profile run of the GSM8K example is ``examples/gsm8k/profile.py``.

``python -m examples.gsm8k.profile run ...`` from the repository root; import it as
``examples.gsm8k.profile`` (same names: ``plan``, ``execute``, ``Plan``, ``OutDirError``,
``previous_profile``, ...). It cannot be re-exported here: the plugin never imports the example.
"""

raise ImportError("megatron_vocabstats.profile.runner moved out of the plugin: import "
                  "examples.gsm8k.profile (from the repository root), run python -m "
                  "examples.gsm8k.profile run ...")
