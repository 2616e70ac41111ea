"""The step report: where each step's time went, how far it is from its ceiling, and what to change.

    timeline  `StepTimeline` measures each step's parts; `StreamReport` and the ceilings
    fields    the report's quantities, one name everywhere (report, JSON, logged scalars)
    format    the report as an aligned text table, with its notes and advice
    advice    what to change, and what it will give, from a run's measured parts
    schedule  the cost model of one step on one link, shared with the planner (`hfstream.plan`)
"""
