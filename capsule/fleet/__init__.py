"""Software updates for a fleet of hosts: its members (``members``), what each holds and runs
(``status``), the staged rollout's plan (``plan``: canaries then waves; ``fanout``: who sends to whom),
its run (``rollout``: stages, failure threshold, per-host events), the calls it makes to hosts
(``hostops``) and the command that ties them together (``push``)."""
