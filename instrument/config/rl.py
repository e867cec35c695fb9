"""``import instrument.config.rl`` (in a ``.gin`` file or in Python) makes the RL classes bindable.

`instrument.rl` itself never imports gin (gin stays at the edge); this module imports it and registers
``RLLogging``, ``CollectionMetrics``, ``TrainMetrics``, ``Counters`` and ``Evaluation`` under ``instrument``.
"""

from instrument.config.registry import register_rl

register_rl()
