"""The registry API's routers, one per concern; each takes the app's parts (:class:`edged.registry.deps.AppContext`)."""
