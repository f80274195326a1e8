"""Stored responses wherever they live: the gateway's store (local arms) or an upstream arm's
own server. GET, DELETE, `input_items` and `previous_response_id` reach the arm that created
the id, through the real `openai` SDK; the upstream is a second Carousel app."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from backends.upstream import UpstreamConfig
from gateway.app import create_app
from gateway.arms.choice import ARM_HEADER
from gateway.arms.deployment import Deployment
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, LiveServer, error_of, serve_app, sim_arm


@contextmanager
def front_of(remote: LiveServer, only: str) -> Iterator[tuple[openai.OpenAI, str]]:
    """A gateway serving `front` with a local sim arm `here` and an upstream arm `remote`
    (the `remote` server); only the arm called `only` takes unrouted traffic."""
    here = sim_arm()
    here.name = "here"
    upstream = UpstreamArm("remote", UpstreamConfig(base_urls=(remote.v1,), model=SIM_MODEL))
    for arm in (here, upstream):
        arm.weight = 1.0 if arm.name == only else 0.0
        arm.pinnable = True  # the tests pin the zero-weight one (X-Carousel-Arm)
    app = create_app(
        Settings(backend="sim", served_model_name="front"), [Deployment("front", [here, upstream])]
    )
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), f"{url}/v1"


def on(arm: str) -> dict[str, str]:
    return {ARM_HEADER: arm}


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)


@pytest.mark.parametrize(
    ("creator", "other", "streamed"),
    [("remote", "here", False), ("remote", "here", True), ("here", "remote", False)],
)
def test_previous_response_id_goes_to_the_arm_that_created_it(
    make_server: Callable[..., LiveServer], creator: str, other: str, streamed: bool
) -> None:
    remote = make_server(sim_arm())
    with front_of(remote, only=other) as (client, _):
        kwargs = {"model": "front", "input": "My name is Ada.", "max_output_tokens": 2}
        if streamed:
            events = list(client.responses.create(**kwargs, stream=True, extra_headers=on(creator)))
            first = events[-1].response  # type: ignore[union-attr]
        else:
            first = client.responses.create(**kwargs, extra_headers=on(creator))
        raw = client.responses.with_raw_response.create(
            model="front", input="And yours?", previous_response_id=first.id, max_output_tokens=2
        )
        second = raw.parse()
        assert raw.headers[ARM_HEADER] == creator  # not `other`, which takes unrouted traffic
        assert second.previous_response_id == first.id and second.model == "front"
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens  # the first turn was there
        # the third turn continues the second, on the same arm again
        third = client.responses.with_raw_response.create(
            model="front", input="Bye.", previous_response_id=second.id, max_output_tokens=1
        )
        assert third.headers[ARM_HEADER] == creator


def test_an_upstream_arms_response_is_retrieved_listed_and_deleted_through_the_gateway(
    make_server: Callable[..., LiveServer],
) -> None:
    remote = make_server(sim_arm())
    with front_of(remote, only="remote") as (client, _):
        created = client.responses.create(model="front", input="Hello", max_output_tokens=3)
        assert asyncio.run(remote.app.state.gateway.response_store.get(created.id)) is not None
        got = client.responses.retrieve(created.id)
        assert got.id == created.id and got.model == "front"
        assert got.output_text == created.output_text
        items = list(client.responses.input_items.list(created.id))
        assert [(i.type, i.role) for i in items] == [("message", "user")]  # type: ignore[union-attr]
        assert items[0].content[0].text == "Hello"  # type: ignore[union-attr]
        deleted = client.responses.delete(created.id)
        assert deleted is None  # the SDK returns nothing; the 200 is what counts
        with pytest.raises(openai.NotFoundError):
            sdk(remote).responses.retrieve(created.id)  # deleted where it lived
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(created.id)
        assert info.value.body["param"] == "response_id"  # type: ignore[index]


def test_a_gateway_never_asks_its_upstream_for_an_id_it_did_not_create(
    make_server: Callable[..., LiveServer],
) -> None:
    """The gateway reaches its upstream with its own credentials: an id it never noted for
    the asking principal is a 404, not a lookup on a guess (issue 38)."""
    remote = make_server(sim_arm())
    made = sdk(remote).responses.create(model=SIM_MODEL, input="Hi", max_output_tokens=2)
    with front_of(remote, only="here") as (client, _):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(
                model="front", input="More", previous_response_id=made.id, max_output_tokens=1
            )
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert sdk(remote).responses.retrieve(made.id).id == made.id  # untouched where it lives


def test_ids_created_on_any_replica_of_an_upstream_arm_are_found_there(
    make_server: Callable[..., LiveServer],
) -> None:
    replicas = [make_server(sim_arm()), make_server(sim_arm())]
    config = UpstreamConfig(base_urls=tuple(r.v1 for r in replicas), model=SIM_MODEL)
    app = create_app(
        Settings(backend="sim", served_model_name="front"),
        [Deployment("front", [UpstreamArm("remote", config)])],
    )
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        made = [
            client.responses.create(model="front", input="Hi", max_output_tokens=1)
            for _ in range(4)
        ]
        for response in made:
            assert client.responses.retrieve(response.id).id == response.id
            client.responses.delete(response.id)
            for replica in replicas:
                with pytest.raises(openai.NotFoundError):
                    sdk(replica).responses.retrieve(response.id)


def test_an_id_unknown_everywhere_is_a_404_naming_it(
    make_server: Callable[..., LiveServer],
) -> None:
    remote = make_server(sim_arm())
    with front_of(remote, only="remote") as (client, v1):
        for method, path in [
            ("GET", "/responses/resp_nope"),
            ("DELETE", "/responses/resp_nope"),
            ("GET", "/responses/resp_nope/input_items"),
            ("GET", "/responses/resp%3Finclude=x"),  # never put into an upstream's URL
        ]:
            error = error_of(httpx.request(method, f"{v1}{path}"), 404)
            assert error["param"] == "response_id", (method, path, error)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(
                model="front", input="x", previous_response_id="resp_nope", max_output_tokens=1
            )
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_input_items_list_a_chained_conversation_in_pages(server: LiveServer) -> None:
    client = sdk(server)
    first = client.responses.create(model=SIM_MODEL, input="One", max_output_tokens=2)
    second = client.responses.create(
        model=SIM_MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Two"}]}],
        instructions="not an item",
        previous_response_id=first.id,
        max_output_tokens=2,
    )
    oldest_first = list(client.responses.input_items.list(second.id, order="asc", limit=1))
    assert [item.type for item in oldest_first] == ["message"] * 3
    texts = [item.content[0].text for item in oldest_first]  # type: ignore[union-attr]
    assert texts == ["One", first.output_text, "Two"]
    assert oldest_first[1].id == first.output[0].id  # the first answer, as it was returned
    assert len({item.id for item in oldest_first}) == 3
    page = client.responses.input_items.list(second.id, limit=2)  # newest first by default
    assert [item.id for item in page.data] == [oldest_first[2].id, oldest_first[1].id]
    assert page.has_more and page.first_id == oldest_first[2].id  # type: ignore[attr-defined]
    rest = client.responses.input_items.list(second.id, limit=2, after=page.data[-1].id)
    assert [item.id for item in rest.data] == [oldest_first[0].id] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(first.id)] == [oldest_first[0].id]


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("limit=0", 400, "limit"),
        ("limit=101", 400, "limit"),
        ("order=sideways", 400, "order"),
        ("after=msg_nope", 404, "after"),
        ("include=message.input_image.image_url", 400, "include"),
    ],
)
def test_bad_input_items_queries_name_their_param(
    server: LiveServer, query: str, status: int, param: str
) -> None:
    made = sdk(server).responses.create(model=SIM_MODEL, input="Hi", max_output_tokens=1)
    response = httpx.get(f"{server.v1}/responses/{made.id}/input_items?{query}")
    assert error_of(response, status)["param"] == param
