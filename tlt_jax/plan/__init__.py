"""Know before you rent (issue #38): the cost of a run's forwards on a hardware profile
(`cost`), the piece the cluster simulator prices its steps with."""
