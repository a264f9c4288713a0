# The usage ledger arrives with the serving issue, prices and invoices with the billing issue.
