"""The offline tools around the services: the ``scd`` command (``tools.cli``), calibration, the
evaluation harness, benchmarks, asset preparation and data. Nothing in ``shared/``,
``producer_service/`` or ``consumer_service/`` imports from here (a test walks the import graph)."""
