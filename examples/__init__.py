"""Example tasks; run them with `python -m hpc_ddp.submit examples/NAME.yaml --local`."""
