"""Tenants' LoRA adapters as objects a tenant owns: upload, validation, storage, publishing
to the serving catalog, deletion, their tasks and their control API. The ``Adapter`` table
stays in ``tenants`` (its migrations live there); the engines' side — loading an adapter on
demand, evicting, unloading a deleted one — is the fleet's and lives in ``inference``.
"""
