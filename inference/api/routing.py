from django.urls import path, re_path

from inference.api import consumers, websocket

http_urlpatterns = [
    path("v1/chat/completions", consumers.ChatCompletionsConsumer.as_asgi()),
    path("v1/completions", consumers.CompletionsConsumer.as_asgi()),
    path("v1/models", consumers.ModelsConsumer.as_asgi()),
    re_path(r"^v1/models/(?P<model>.+)$", consumers.ModelsConsumer.as_asgi()),
    re_path(r"^v1/", consumers.NotFoundConsumer.as_asgi()),
]

websocket_urlpatterns = [
    path("v1/ws", websocket.GatewayWebSocketConsumer.as_asgi()),
]
