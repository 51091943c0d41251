"""The ``nvmeswap`` command: bench (ds_io), tune (ds_nvme_tune), report (ds_report)."""
