import openai
from openai import OpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
EV = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type":"function","name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}},
         {"type":"function","name":"get_time","parameters":{"type":"object","properties":{}}}]
bad = OpenAI(base_url="http://127.0.0.1:8107/v1", api_key="wrong", max_retries=0)
for f in [lambda: bad.responses.create(model="tt", input="x", max_output_tokens=3), lambda: list(bad.responses.create(model="tt", input="x", max_output_tokens=3, stream=True)), lambda: bad.models.list()]:
    try: f(); print("no error!")
    except openai.APIError as e: print(type(e).__name__, e.status_code, e.message)
c = OpenAI(base_url="http://127.0.0.1:8107/v1", api_key="sk-test", max_retries=0)
evs = list(c.responses.create(model="tt", input="Weather?", tools=TOOLS, max_output_tokens=30, temperature=0, stream=True))
for e in evs: EV.validate_python(e.to_dict())
print(len(evs), [e.sequence_number for e in evs] == list(range(len(evs))), evs[-1].type, [o.type for o in evs[-1].response.output])
with c.responses.stream(model="tt", input="Weather?", tools=TOOLS, max_output_tokens=30, temperature=0) as s:
    for e in s: pass
    print("helper", s.get_final_response().status)
import httpx
raw = httpx.post("http://127.0.0.1:8107/v1/responses", headers={"Authorization": "Bearer sk-test"}, json={"model":"tt","input":"Weather?","tools":TOOLS,"max_output_tokens":30,"temperature":0,"stream":True}).text
print("keepalives:", raw.count(": keep-alive"))
