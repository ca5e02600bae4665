"""Ad hoc: the same greedy and seeded request 5 times, streamed and not, against a running default serve."""
import json, sys
import openai
c = openai.OpenAI(base_url="http://127.0.0.1:8799/v1", api_key="x", max_retries=0, timeout=300)
qs = [json.loads(l) for l in open("/work/shared/data/spec_bench_questions.jsonl")]
long = [q for q in qs if len(" ".join(q["turns"][0].split())) > 1500][:2]
short = qs[:2]
res = {}
for q in short + long:
    prompt = q["turns"][0]
    for kind, kw in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 7})):
        texts, cached = [], []
        for i in range(5):
            stream = i % 2 == 1
            m = [{"role": "user", "content": prompt}]
            if stream:
                ch = list(c.chat.completions.create(model="smollm2-135m-instruct", messages=m, max_tokens=48, stream=True, stream_options={"include_usage": True}, **kw))
                texts.append("".join(x.choices[0].delta.content or "" for x in ch if x.choices)); u = ch[-1].usage
            else:
                r = c.chat.completions.create(model="smollm2-135m-instruct", messages=m, max_tokens=48, **kw)
                texts.append(r.choices[0].message.content); u = r.usage
            cached.append((u.prompt_tokens, u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None))
        same = all(t == texts[0] for t in texts)
        print(q.get("question_id"), kind, "identical" if same else "DIFFER", cached, flush=True)
