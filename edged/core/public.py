"""The names of core that code outside it may use besides the service: what the façade hands out.

Everything else in ``edged.core`` (the manager, the loader, the table, schedulers, the pipeline
gateway) is reached only through :class:`edged.core.service.InferenceService`; the architecture
check (tools/archgraph.py) fails an import of any other core module from outside core.
"""

from __future__ import annotations

from edged.core.model_versions import ModelState, ModelVersion, choice_line, sample_inputs
from edged.core.stats import ModelStats

__all__ = ["ModelState", "ModelStats", "ModelVersion", "choice_line", "sample_inputs"]
