"""The fleet: the models tenants call, the pools that serve them and the replicas in each
(engines), and what is read from an engine's own metrics. The bottom of the data plane:
prices, the ledger and adapters refer to it; it imports no other app but tenants."""
