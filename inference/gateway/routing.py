from django.urls import path, re_path

from inference.gateway import v1, v1_responses, websocket

http_urlpatterns = [
    path("v1/chat/completions", v1.ChatCompletionsConsumer.as_asgi()),
    path("v1/completions", v1.CompletionsConsumer.as_asgi()),
    path("v1/embeddings", v1.EmbeddingsConsumer.as_asgi()),
    path("v1/responses", v1_responses.ResponsesConsumer.as_asgi()),
    path("v1/responses/<str:response_id>", v1_responses.ResponseConsumer.as_asgi()),
    path(
        "v1/responses/<str:response_id>/input_items",
        v1_responses.ResponseInputItemsConsumer.as_asgi(),
    ),
    path("v1/models", v1.ModelsConsumer.as_asgi()),
    re_path(r"^v1/models/(?P<model>.+)$", v1.ModelsConsumer.as_asgi()),
    re_path(r"^v1/", v1.NotFoundConsumer.as_asgi()),
]

websocket_urlpatterns = [
    path("v1/ws", websocket.GatewayWebSocketConsumer.as_asgi()),
]
