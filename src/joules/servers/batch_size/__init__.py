"""The batch-size optimizer server (``joules serve``): jobs, trials and policy state in a database."""
