// Stand-in for Apple's <objc/runtime.h> (not on Linux): the runtime types and lookups metal-cpp uses.
#pragma once

typedef struct objc_class* Class;
typedef struct objc_selector* SEL;
struct objc_object {
  Class isa;
};
typedef struct objc_object Protocol;

extern "C" {
SEL sel_registerName(const char* name);
Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
}
