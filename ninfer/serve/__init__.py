"""The HTTP server: OpenAI Chat Completions, Responses and Anthropic Messages over one Engine, as one pipeline.

`app` builds the FastAPI application (plain routes, middleware) and mounts the router of each API module
(`openai_chat`, `responses`, `anthropic_messages`). An API module depends on the shared modules, never the reverse;
it exposes `router(state: ServerState) -> APIRouter` and builds its routes from these pieces:

    body = await parse_body(http_request, MyRequest)      # schema: 400 naming the field on any schema violation
    check_model(state, body.model)                          # state: 404 model_not_found (if the API checks it)
    thinking = resolve_thinking(state.config.default_thinking, ("thinking", ...))
    conversation = Conversation(messages, tools, thinking)  # conversation: OpenAI-shape messages, tools.FunctionTool
    request = await run_in_threadpool(engine_request, state, conversation, Sampling(max_tokens=...), new_id("x-"))
    record_of(http_request).update(id=request.request_id, stream=..., thinking=thinking)   # request_log
    return await respond(state, http_request, request, MyAnswer(...), stream=bool(body.stream))   # answer

`MyAnswer` subclasses `answer.Answer`: the API's wire format of one answer, whole (`whole(result)`, JSON) or
streamed (`opening`, `chunks(event)`, `failure(error)`, `closing(result)`: server-sent events, `sse`). `respond`
runs the request on the engine (`generation`: refusals as APIErrors, cancelled when the client hangs up) and
answers a refusal before the first event with its HTTP status, a failure after it in-band. An answer made of parts
(Anthropic content blocks, Responses output items) builds them with `answer.OrderedParts`, so that the whole and the
streamed answer have the same content.

Errors are raised as `errors.APIError`; the app renders them in the body shape of the API the path belongs to:
OpenAI `{"error": {message, type, param, code}}` everywhere except `/v1/messages*`, which gets Anthropic's
`{"type": "error", "error": {type, message}}`. Each request writes one line to the request log (`request_log`).
"""
