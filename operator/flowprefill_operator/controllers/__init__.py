"""The operator's controllers, one module per piece of state it owns.

``indexes`` (kopf indexes: pools by service, SLOClasses by namespace), ``servingpool``
(a pool's children and status), ``gateway`` (a service's gateway and SLO table),
``sloclass`` (class acceptance), ``scraper`` (observed attainment), ``autoscaler``
(replicas of the pools the operator owns, from the scraped windows), ``common`` (the
context kept in kopf's memo, locks, Events, error mapping). Importing a module registers
its kopf handlers; ``flowprefill_operator.handlers`` imports them all.
"""
