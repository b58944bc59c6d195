"""One adapter per HTTP API, each translating its wire format to and from the turn pipeline (contract: ``base``).

To add an API: a module here with its request schema (the subclass's ``request_schema``, which ``GET /openapi.json``
documents) and a ``TurnAdapter`` subclass (``parse``, ``reply_id``,
``respond``, ``writer`` returning its ``StreamWriter``), and one ``self._mount(app, path, Adapter(self.model_name))`` line in
``ProxyServer._build_app``.
"""
