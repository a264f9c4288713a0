"""The dashboard's pages: thin views over the same selectors and services as the control API,
one module per area (``overview``, ``api_keys``, ``lora``, ``batch_jobs``, ``people``,
``policies``, ``spend``, ``platform_ops``, ``playground``; ``common`` what every page has).

Every tenant page takes the tenant's slug from the URL and goes through ``page_access``: an
outsider gets 404, a member whose role does not allow the page 403 (and the links to what a
role may not do are not shown in the first place).
"""
